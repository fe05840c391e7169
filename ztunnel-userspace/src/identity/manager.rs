//! Issues, caches and rotates the certificates of local workloads.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use rustls::sign::CertifiedKey;

use super::{Identity, IdentityError, ca::CertificateAuthority};

/// Default certificate lifetime (Istio's default workload cert TTL).
pub const DEFAULT_LIFETIME: Duration = Duration::from_secs(24 * 3600);

struct Issued {
    key: Arc<CertifiedKey>,
    /// When we issued it; rotation is due at `minted_at + lifetime / 2`
    /// (`not_before` is backdated for clock skew, so it is not used here).
    minted_at: SystemTime,
    not_before: SystemTime,
    not_after: SystemTime,
}

/// What the admin dump shows of a certificate (never the key).
#[derive(Debug, Clone, serde::Serialize)]
pub struct CertInfo {
    /// The SPIFFE id.
    pub identity: String,
    /// Start of validity, seconds since the epoch.
    pub not_before: u64,
    /// End of validity, seconds since the epoch.
    pub not_after: u64,
    /// Certificates in the chain sent to peers.
    pub chain_length: usize,
}

/// Certificates of the workloads on this node.
pub struct CertManager {
    ca: CertificateAuthority,
    lifetime: Duration,
    issued: Mutex<HashMap<Identity, Issued>>,
    rotations: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for CertManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertManager")
            .field("lifetime", &self.lifetime)
            .finish_non_exhaustive()
    }
}

impl CertManager {
    /// A manager issuing from `ca` with `lifetime` per certificate.
    pub fn new(ca: CertificateAuthority, lifetime: Duration) -> Self {
        Self {
            ca,
            lifetime,
            issued: Mutex::new(HashMap::new()),
            rotations: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The trust anchors peers are verified against.
    pub fn roots(&self) -> rustls::RootCertStore {
        let mut store = rustls::RootCertStore::empty();
        for root in self.ca.roots() {
            let _ = store.add(root.clone());
        }
        store
    }

    /// The current certificate of `identity`, issued on first use and
    /// replaced once half its lifetime has passed. Handshakes call this, so
    /// a replacement only affects connections opened afterwards.
    pub fn certified_key(&self, identity: &Identity) -> Result<Arc<CertifiedKey>, IdentityError> {
        let now = SystemTime::now();
        let mut issued = self
            .issued
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(current) = issued.get(identity) {
            let half = current.minted_at
                + current
                    .not_after
                    .duration_since(current.minted_at)
                    .unwrap_or_default()
                    / 2;
            if now < half {
                return Ok(Arc::clone(&current.key));
            }
            self.rotations
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(%identity, "certificate past half-life: rotating");
        }
        let cert = self.ca.issue(identity, self.lifetime)?;
        let provider = crate::tls::provider();
        let signing_key = provider
            .key_provider
            .load_private_key(cert.key)
            .map_err(|e| IdentityError::Issue {
                identity: identity.to_string(),
                message: e.to_string(),
            })?;
        let key = Arc::new(CertifiedKey::new(cert.chain, signing_key));
        tracing::info!(%identity, lifetime_s = self.lifetime.as_secs(), "issued workload certificate");
        issued.insert(
            identity.clone(),
            Issued {
                key: Arc::clone(&key),
                minted_at: now,
                not_before: cert.not_before,
                not_after: cert.not_after,
            },
        );
        Ok(key)
    }

    /// Certificates currently held, for the admin dump.
    pub fn dump(&self) -> Vec<CertInfo> {
        let secs = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        };
        let issued = self
            .issued
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out: Vec<CertInfo> = issued
            .iter()
            .map(|(id, i)| CertInfo {
                identity: id.to_string(),
                not_before: secs(i.not_before),
                not_after: secs(i.not_after),
                chain_length: i.key.cert.len(),
            })
            .collect();
        out.sort_by(|a, b| a.identity.cmp(&b.identity));
        out
    }

    /// Drops the certificate of `identity` (no enrolled pod has it any
    /// more), so that pods that come and go do not pile up keys. A pod of
    /// that identity enrolled later gets a fresh one. Returns whether one
    /// was held.
    pub fn forget(&self, identity: &Identity) -> bool {
        self.issued
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(identity)
            .is_some()
    }

    /// How many certificates were replaced because of age.
    pub fn rotations(&self) -> u64 {
        self.rotations.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_until_half_life_then_rotates() {
        let dir = std::env::temp_dir().join(format!("zt-mgr-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = CertificateAuthority::development(&dir, "cluster.local").expect("ca");
        let short = CertManager::new(ca, Duration::from_secs(1));
        let id = Identity::new("cluster.local", "demo", "a1");
        let a = short.certified_key(&id).expect("issue");
        assert!(Arc::ptr_eq(&a, &short.certified_key(&id).expect("cached")));
        std::thread::sleep(Duration::from_millis(600));
        let b = short.certified_key(&id).expect("rotate");
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(short.rotations(), 1);

        let ca = CertificateAuthority::development(&dir, "cluster.local").expect("ca");
        let long = CertManager::new(ca, DEFAULT_LIFETIME);
        let a = long.certified_key(&id).expect("issue");
        let b = long.certified_key(&id).expect("cached");
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(long.dump().len(), 1);
        assert!(long.forget(&id));
        assert!(long.dump().is_empty());
        assert!(!long.forget(&id));
        let c = long.certified_key(&id).expect("issued again");
        assert!(!Arc::ptr_eq(&a, &c));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
