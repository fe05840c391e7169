//! Certificates from Istio's CA: istiod's `IstioCertificateService`.
//!
//! One call per certificate: a fresh P-256 key made here (it never leaves
//! the node), a CSR carrying the SPIFFE id as its only URI SAN, and back a
//! PEM chain, leaf first and root last. What comes back is checked before
//! it is used: the leaf must carry exactly the identity asked for, hold our
//! key, and chain to the mesh root ztunnel trusts; a CA that answers
//! otherwise is refused, with the reason, rather than believed.
//!
//! Every call is authenticated the way istiod expects from a node proxy:
//! `authorization: Bearer <token>` (the file is read again for each call,
//! because the kubelet rotates projected tokens), `clusterid`, and for a
//! workload's identity (not ztunnel's own) the `ImpersonatedIdentity`
//! metadata field. istiod's TLS certificate is verified against the root
//! file (`CA_ROOT_CA`), the same root workload certificates chain to.

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, UnixTime};
use tonic::transport::Channel;

use super::{Identity, IdentityError, ca::WorkloadCert, identity_of};
use crate::istiod::{self, Calls, ChannelError};
use crate::proto::istio_ca::{
    IstioCertificateRequest, istio_certificate_service_client::IstioCertificateServiceClient,
};

/// The whole call (connect, TLS, request, answer) must end within this.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(20);
use istiod::CONNECT_TIMEOUT;
/// The metadata key istiod reads the identity to sign for from, when the
/// caller (ztunnel) asks on behalf of a workload.
pub const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";

/// Where the CA is and how to talk to it.
#[derive(Debug, Clone)]
pub struct IstioCaSettings {
    /// `host:port` (an `https://` prefix is accepted); `host` is also the
    /// name istiod's certificate must carry (DNS or IP SAN).
    pub address: String,
    /// PEM root(s): verify istiod's TLS certificate, and are the mesh's
    /// trust anchors for workload certificates.
    pub root_cert: PathBuf,
    /// The bearer token file (a projected service account token).
    pub token: PathBuf,
    /// Sent as `clusterid`.
    pub cluster_id: String,
    /// ztunnel's own identity: no impersonation metadata for it.
    pub own_identity: Identity,
    /// Requested lifetime (`validity_duration`).
    pub ttl: Duration,
}

/// A client of the CA.
pub struct IstioCa {
    settings: IstioCaSettings,
    host: String,
    roots: Vec<CertificateDer<'static>>,
    channel: Channel,
}

impl std::fmt::Debug for IstioCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IstioCa")
            .field("address", &self.settings.address)
            .finish_non_exhaustive()
    }
}

impl IstioCa {
    /// Reads the root file and prepares the channel; nothing is dialled
    /// until the first certificate is asked for.
    pub fn new(settings: IstioCaSettings) -> Result<Self, IdentityError> {
        let made = istiod::channel(
            &settings.address,
            &settings.root_cert,
            Calls::Bounded(CALL_TIMEOUT),
        )
        .map_err(|e| match e {
            ChannelError::Address(message) => IdentityError::CaAddress {
                address: settings.address.clone(),
                message,
            },
            ChannelError::Root(message) => IdentityError::CaFile {
                path: settings.root_cert.clone(),
                message,
            },
        })?;
        let roots = parse_pem_certs(&made.root_pem).map_err(|message| IdentityError::CaFile {
            path: settings.root_cert.clone(),
            message,
        })?;
        Ok(Self {
            settings,
            host: made.host,
            roots,
            channel: made.channel,
        })
    }

    /// The mesh's trust anchors (from the root file).
    pub fn roots(&self) -> &[CertificateDer<'static>] {
        &self.roots
    }

    /// The CA's address, as configured.
    pub fn address(&self) -> &str {
        &self.settings.address
    }

    /// The name istiod's certificate is checked against.
    pub fn server_name(&self) -> &str {
        &self.host
    }

    /// Asks the CA for a certificate of `identity`.
    pub async fn fetch(&self, identity: &Identity) -> Result<WorkloadCert, IdentityError> {
        let err = |message: String| IdentityError::Ca {
            address: self.settings.address.clone(),
            identity: identity.to_string(),
            message,
        };
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| err(format!("generating a key: {e}")))?;
        let csr = csr_pem(identity, &key).map_err(|e| err(format!("making the CSR: {e}")))?;
        let mut request = tonic::Request::new(IstioCertificateRequest {
            csr,
            validity_duration: i64::try_from(self.settings.ttl.as_secs()).unwrap_or(i64::MAX),
            metadata: (identity != &self.settings.own_identity).then(|| impersonation(identity)),
        });
        request.set_timeout(CALL_TIMEOUT);
        istiod::authenticate(
            &mut request,
            &self.settings.token,
            &self.settings.cluster_id,
        )
        .map_err(err)?;
        let mut client = IstioCertificateServiceClient::new(self.channel.clone());
        let call = client.create_certificate(request);
        // tonic's own timeouts cover connect and the call; this one covers
        // anything they miss (every wait in the product has a bound).
        let response = match tokio::time::timeout(CALL_TIMEOUT + CONNECT_TIMEOUT, call).await {
            Err(_) => return Err(err(format!("no answer within {CALL_TIMEOUT:?}"))),
            Ok(Err(status)) => return Err(err(istiod::describe(&status))),
            Ok(Ok(response)) => response.into_inner(),
        };
        self.check_answer(identity, &key, &response.cert_chain)
            .map_err(err)
    }

    /// Turns the CA's PEM chain into what ztunnel presents, refusing any
    /// answer peers would refuse (or that would name someone else).
    fn check_answer(
        &self,
        identity: &Identity,
        key: &rcgen::KeyPair,
        pems: &[String],
    ) -> Result<WorkloadCert, String> {
        let mut chain = Vec::new();
        for pem in pems {
            chain.extend(parse_pem_certs(pem)?);
        }
        if chain.is_empty() {
            return Err("the answer holds no certificate".to_owned());
        }
        // Leaf first, root last: the root is not sent to peers (they have
        // it), so drop it. Only a self-signed last certificate is a root: a
        // CA that ends its chain at an intermediate keeps it.
        if chain.len() > 1 && chain.last().is_some_and(|c| self_signed(c)) {
            chain.pop();
        }
        let leaf = &chain[0];
        match identity_of(leaf) {
            Some(got) if &got == identity => {}
            Some(got) => return Err(format!("the CA signed {got}, not the identity asked for")),
            None => {
                return Err(format!(
                    "the leaf has no single SPIFFE id (URI SANs: [{}])",
                    super::uri_sans(leaf).join(",")
                ));
            }
        }
        let (not_before, not_after, spki) = {
            use x509_parser::prelude::{FromDer, X509Certificate};
            let (_, cert) = X509Certificate::from_der(leaf)
                .map_err(|e| format!("the leaf does not parse: {e}"))?;
            let validity = cert.validity();
            let at = |t: x509_parser::time::ASN1Time| {
                SystemTime::UNIX_EPOCH
                    + Duration::from_secs(u64::try_from(t.timestamp()).unwrap_or(0))
            };
            (
                at(validity.not_before),
                at(validity.not_after),
                cert.public_key().subject_public_key.data.to_vec(),
            )
        };
        if spki != key.public_key_raw() {
            return Err("the leaf does not hold the key of our CSR".to_owned());
        }
        if not_after <= SystemTime::now() {
            return Err("the leaf has already expired".to_owned());
        }
        // The chain must lead to a root we trust, with the SPIFFE id in the
        // trust domain: the same check every peer makes.
        let mut store = rustls::RootCertStore::empty();
        for root in &self.roots {
            let _ = store.add(root.clone());
        }
        let verifier = crate::tls::verify::SpiffeClientVerifier::new(
            store,
            &identity.trust_domain,
            crate::tls::provider(),
        )
        .map_err(|e| format!("the trust anchors are unusable: {e}"))?;
        rustls::server::danger::ClientCertVerifier::verify_client_cert(
            &verifier,
            leaf,
            &chain[1..],
            UnixTime::now(),
        )
        .map_err(|e| {
            format!(
                "the chain does not verify against the root in {}: {e}",
                self.settings.root_cert.display()
            )
        })?;
        Ok(WorkloadCert {
            chain,
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            not_before,
            not_after,
        })
    }
}

/// Whether a certificate names itself as its issuer (a root).
fn self_signed(der: &[u8]) -> bool {
    use x509_parser::prelude::{FromDer, X509Certificate};
    X509Certificate::from_der(der).is_ok_and(|(_, c)| c.subject().as_raw() == c.issuer().as_raw())
}

/// A CSR whose only SAN is the SPIFFE id.
fn csr_pem(identity: &Identity, key: &rcgen::KeyPair) -> Result<String, rcgen::Error> {
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.subject_alt_names = vec![rcgen::SanType::URI(identity.to_string().try_into()?)];
    params.serialize_request(key)?.pem()
}

/// `metadata` naming the workload ztunnel asks for.
fn impersonation(identity: &Identity) -> prost_types::Struct {
    prost_types::Struct {
        fields: [(
            IMPERSONATED_IDENTITY.to_owned(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue(identity.to_string())),
            },
        )]
        .into(),
    }
}

/// Every certificate in a PEM text.
pub fn parse_pem_certs(pem: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Result<Vec<_>, _> = rustls_pemfile::certs(&mut pem.as_bytes()).collect();
    let certs = certs.map_err(|e| format!("not PEM: {e}"))?;
    if certs.is_empty() {
        return Err("no PEM certificate in it".to_owned());
    }
    Ok(certs)
}

/// Shared by the manager: the client behind an `Arc`.
pub type SharedIstioCa = Arc<IstioCa>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A root, an intermediate under it, and a CA client trusting the root.
    struct Pki {
        dir: PathBuf,
        root: rcgen::Certificate,
        inter: rcgen::Certificate,
        inter_issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
        other_issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
        ca: IstioCa,
    }

    fn ca_params(name: &str) -> rcgen::CertificateParams {
        let mut p = rcgen::CertificateParams::default();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        p.distinguished_name
            .push(rcgen::DnType::CommonName, name.to_owned());
        p
    }

    fn pki(tag: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("zt-istio-ca-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let root_key = rcgen::KeyPair::generate().expect("key");
        let root_params = ca_params("test root");
        let root = root_params.self_signed(&root_key).expect("root");
        let root_issuer = rcgen::Issuer::new(root_params, root_key);
        let inter_key = rcgen::KeyPair::generate().expect("key");
        let inter_params = ca_params("test intermediate");
        let inter = inter_params
            .signed_by(&inter_key, &root_issuer)
            .expect("intermediate");
        let inter_issuer = rcgen::Issuer::new(inter_params, inter_key);
        let other_key = rcgen::KeyPair::generate().expect("key");
        let other_issuer = rcgen::Issuer::new(ca_params("someone else's root"), other_key);
        std::fs::write(dir.join("root.pem"), root.pem()).expect("write root");
        let ca = IstioCa::new(IstioCaSettings {
            address: "127.0.0.1:15012".to_owned(),
            root_cert: dir.join("root.pem"),
            token: dir.join("token"),
            cluster_id: "c".to_owned(),
            own_identity: Identity::new("cluster.local", "istio-system", "ztunnel"),
            ttl: Duration::from_secs(3600),
        })
        .expect("client");
        Pki {
            dir,
            root,
            inter,
            inter_issuer,
            other_issuer,
            ca,
        }
    }

    fn leaf(
        key: &rcgen::KeyPair,
        san: &str,
        issuer: &rcgen::Issuer<'static, rcgen::KeyPair>,
    ) -> String {
        let mut p = rcgen::CertificateParams::default();
        p.subject_alt_names = vec![rcgen::SanType::URI(san.try_into().expect("uri"))];
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.signed_by(key, issuer).expect("leaf").pem()
    }

    #[tokio::test]
    async fn answers_are_checked_before_use() {
        let pki = pki("answers");
        let id = Identity::new("cluster.local", "demo", "a1");
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
        let good = leaf(&key, &id.to_string(), &pki.inter_issuer);
        let (inter, root) = (pki.inter.pem(), pki.root.pem());

        // leaf, intermediate, root: the root is dropped, the rest sent.
        let cert = pki
            .ca
            .check_answer(&id, &key, &[good.clone(), inter.clone(), root.clone()])
            .expect("a good answer");
        assert_eq!(cert.chain.len(), 2);
        // A chain that ends at the intermediate keeps it.
        let cert = pki
            .ca
            .check_answer(&id, &key, &[good.clone(), inter.clone()])
            .expect("no root in the answer");
        assert_eq!(cert.chain.len(), 2);

        let refused = |pems: &[String]| {
            pki.ca
                .check_answer(&id, &key, pems)
                .expect_err("must be refused")
        };
        let other = leaf(
            &key,
            "spiffe://cluster.local/ns/demo/sa/b1",
            &pki.inter_issuer,
        );
        assert!(
            refused(&[other, inter.clone(), root.clone()]).contains("not the identity asked for")
        );
        let stranger_key = rcgen::KeyPair::generate().expect("key");
        let not_ours = leaf(&stranger_key, &id.to_string(), &pki.inter_issuer);
        assert!(refused(&[not_ours, inter.clone(), root.clone()]).contains("key of our CSR"));
        let foreign = leaf(&key, &id.to_string(), &pki.other_issuer);
        assert!(refused(&[foreign, root.clone()]).contains("does not verify"));
        // Missing intermediate: cannot chain to the root.
        assert!(refused(&[good, root]).contains("does not verify"));
        assert!(refused(&[]).contains("no certificate"));
        assert!(refused(&["junk".to_owned()]).contains("PEM"));
        let _ = std::fs::remove_dir_all(&pki.dir);
    }

    #[test]
    fn csr_carries_the_spiffe_id_and_impersonation_names_it() {
        let id = Identity::new("cluster.local", "demo", "a1");
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
        let pem = csr_pem(&id, &key).expect("csr");
        let parsed = rcgen::CertificateSigningRequestParams::from_pem(&pem).expect("parses");
        let sans: Vec<String> = parsed
            .params
            .subject_alt_names
            .iter()
            .map(|s| format!("{s:?}"))
            .collect();
        assert_eq!(sans.len(), 1);
        assert!(
            sans[0].contains("spiffe://cluster.local/ns/demo/sa/a1"),
            "{sans:?}"
        );
        let meta = impersonation(&id);
        assert_eq!(
            meta.fields[IMPERSONATED_IDENTITY].kind,
            Some(prost_types::value::Kind::StringValue(
                "spiffe://cluster.local/ns/demo/sa/a1".to_owned()
            ))
        );
    }
}
