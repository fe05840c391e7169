//! Certificate authorities: the built-in development CA, or CA files.

use std::{
    fs,
    io::Write as _,
    os::unix::fs::OpenOptionsExt as _,
    path::Path,
    time::{Duration, SystemTime},
};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use super::{Identity, IdentityError};

/// File names of the development CA inside its folder.
pub const DEV_CA_CERT: &str = "ca-cert.pem";
/// File name of the development CA's key (mode 0600).
pub const DEV_CA_KEY: &str = "ca-key.pem";
/// The development root is valid this long.
const DEV_ROOT_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Backdating of issued certificates, for clocks that differ a little.
const CLOCK_SKEW: Duration = Duration::from_secs(5 * 60);

/// A freshly issued workload certificate.
pub struct WorkloadCert {
    /// Leaf first, then any intermediates.
    pub chain: Vec<CertificateDer<'static>>,
    /// The leaf's private key (PKCS#8). Never printed: see the `Debug` impl.
    pub key: PrivateKeyDer<'static>,
    /// Start of validity.
    pub not_before: SystemTime,
    /// End of validity.
    pub not_after: SystemTime,
}

impl std::fmt::Debug for WorkloadCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkloadCert")
            .field("chain_len", &self.chain.len())
            .field("not_before", &self.not_before)
            .field("not_after", &self.not_after)
            .field("key", &"<redacted>")
            .finish()
    }
}

/// Signs workload certificates.
pub struct CertificateAuthority {
    issuer_der: CertificateDer<'static>,
    issuer_key: KeyPair,
    /// Certificates sent after the leaf (an intermediate, if any).
    intermediates: Vec<CertificateDer<'static>>,
    /// Trust anchors peers are verified against.
    roots: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .field("intermediates", &self.intermediates.len())
            .field("roots", &self.roots.len())
            .finish_non_exhaustive()
    }
}

fn ca_err(path: &Path, message: impl std::fmt::Display) -> IdentityError {
    IdentityError::CaFile {
        path: path.to_path_buf(),
        message: message.to_string(),
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, IdentityError> {
    let pem = fs::read(path).map_err(|e| ca_err(path, e))?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|e| ca_err(path, e))?;
    if certs.is_empty() {
        return Err(ca_err(path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

impl CertificateAuthority {
    /// Loads a CA from files: the signing certificate and its key, plus the
    /// root when the signing certificate is an intermediate.
    pub fn from_files(cert: &Path, key: &Path, root: Option<&Path>) -> Result<Self, IdentityError> {
        let mut certs = read_certs(cert)?;
        let issuer_der = certs.remove(0);
        let key_pem = fs::read_to_string(key).map_err(|e| ca_err(key, e))?;
        let issuer_key = KeyPair::from_pem(&key_pem).map_err(|e| ca_err(key, e))?;
        // Check the pair before we sign anything with it.
        Issuer::from_ca_cert_der(&issuer_der, &issuer_key).map_err(|e| ca_err(cert, e))?;
        let (intermediates, roots) = match root {
            Some(root) => (
                std::iter::once(issuer_der.clone()).chain(certs).collect(),
                read_certs(root)?,
            ),
            None => (
                Vec::new(),
                std::iter::once(issuer_der.clone()).chain(certs).collect(),
            ),
        };
        Ok(Self {
            issuer_der,
            issuer_key,
            intermediates,
            roots,
        })
    }

    /// The development CA kept in `dir`: loaded if it exists, generated
    /// (under a lock, so ztunnels of several nodes starting together agree)
    /// otherwise. The key file is created with mode 0600.
    pub fn development(dir: &Path, trust_domain: &str) -> Result<Self, IdentityError> {
        fs::create_dir_all(dir).map_err(|e| ca_err(dir, e))?;
        let lock_path = dir.join(".lock");
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| ca_err(&lock_path, e))?;
        let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| ca_err(&lock_path, e))?;
        let (cert, key) = (dir.join(DEV_CA_CERT), dir.join(DEV_CA_KEY));
        if !(cert.exists() && key.exists()) {
            generate_dev_root(&cert, &key, trust_domain)?;
            tracing::info!(ca = %cert.display(), "generated a development CA");
        }
        Self::from_files(&cert, &key, None)
    }

    /// The trust anchors.
    pub fn roots(&self) -> &[CertificateDer<'static>] {
        &self.roots
    }

    /// Issues a certificate for `identity`: one URI SAN, EKU serverAuth and
    /// clientAuth, ECDSA P-256, valid from now (minus clock skew) for
    /// `lifetime`.
    pub fn issue(
        &self,
        identity: &Identity,
        lifetime: Duration,
    ) -> Result<WorkloadCert, IdentityError> {
        let err = |e: rcgen::Error| IdentityError::Issue {
            identity: identity.to_string(),
            message: e.to_string(),
        };
        let issuer = Issuer::from_ca_cert_der(&self.issuer_der, &self.issuer_key).map_err(err)?;
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(err)?;
        let mut params = CertificateParams::default();
        let uri = identity.to_string().try_into().map_err(err)?;
        params.subject_alt_names = vec![SanType::URI(uri)];
        params.distinguished_name = DistinguishedName::new();
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.use_authority_key_identifier_extension = true;
        let now = SystemTime::now();
        let not_before = now - CLOCK_SKEW;
        let not_after = now + lifetime;
        params.not_before = not_before.into();
        params.not_after = not_after.into();
        let leaf = params.signed_by(&key, &issuer).map_err(err)?;
        let mut chain = vec![leaf.der().clone()];
        chain.extend(self.intermediates.iter().cloned());
        Ok(WorkloadCert {
            chain,
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            not_before,
            not_after,
        })
    }
}

fn generate_dev_root(cert: &Path, key: &Path, trust_domain: &str) -> Result<(), IdentityError> {
    let err = |e: rcgen::Error| ca_err(cert, e);
    let pair = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(err)?;
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, trust_domain);
    // A per-CA suffix: two development CAs never share a name, so a peer
    // from another CA fails with "unknown issuer", not a signature error.
    let suffix = pair
        .public_key_raw()
        .iter()
        .skip(1)
        .take(4)
        .fold(String::new(), |mut s, b| {
            use std::fmt::Write as _;
            let _ = write!(s, "{b:02x}");
            s
        });
    dn.push(
        DnType::CommonName,
        format!("ztunnel-rs development CA {suffix}"),
    );
    params.distinguished_name = dn;
    let now = SystemTime::now();
    params.not_before = (now - CLOCK_SKEW).into();
    params.not_after = (now + DEV_ROOT_LIFETIME).into();
    let root = params.self_signed(&pair).map_err(err)?;
    write_private(key, pair.serialize_pem().as_bytes())?;
    fs::write(cert, root.pem()).map_err(|e| ca_err(cert, e))?;
    Ok(())
}

fn write_private(path: &Path, data: &[u8]) -> Result<(), IdentityError> {
    let mut f = fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| ca_err(path, e))?;
    f.write_all(data).map_err(|e| ca_err(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::{identity_of, uri_sans};

    #[test]
    fn issues_a_leaf_with_one_spiffe_san_chained_to_the_root() {
        let dir = std::env::temp_dir().join(format!("zt-ca-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let ca = CertificateAuthority::development(&dir, "cluster.local").expect("dev CA");
        let id = Identity::new("cluster.local", "demo", "a1");
        let cert = ca.issue(&id, Duration::from_secs(3600)).expect("issue");
        assert_eq!(uri_sans(&cert.chain[0]), vec![id.to_string()]);
        assert_eq!(identity_of(&cert.chain[0]), Some(id));
        assert!(
            !format!("{cert:?}").contains("BEGIN"),
            "Debug must not show keys"
        );
        // A second load reuses the same CA (nodes share it).
        let again = CertificateAuthority::development(&dir, "cluster.local").expect("reload");
        assert_eq!(again.roots(), ca.roots());
        let mode = fs::metadata(dir.join(DEV_CA_KEY))
            .expect("key")
            .permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
