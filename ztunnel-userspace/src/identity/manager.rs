//! Holds, issues and rotates the certificates of this node's workloads.
//!
//! Two sources:
//! - a local CA (development CA or CA files): a certificate is signed in
//!   place on first use and again once half its lifetime has passed;
//! - Istio's CA (`istio_ca`): certificates are asked for in the background,
//!   one task per identity, as soon as a pod of that identity is enrolled;
//!   the task asks again at half-life, backs off on failure (500 ms doubling
//!   to 150 s) while the current certificate stays in use, and at most
//!   [`MAX_CONCURRENT_CSRS`] requests are in flight at once, so a node full
//!   of new pods does not stampede istiod. A handshake never waits on the
//!   CA: it takes what is held. Connection set-up waits, bounded, for the
//!   first certificate ([`CertManager::wait_ready`]).
//!
//! Either way a handshake asks for the current certificate, so rotation
//! never touches connections that are already open.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use rustls::sign::CertifiedKey;

use super::{
    Identity, IdentityError,
    ca::{CertificateAuthority, WorkloadCert},
    istio_ca::IstioCa,
};

/// Default certificate lifetime (Istio's default workload cert TTL).
pub const DEFAULT_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// Requests to Istio's CA in flight at once.
pub const MAX_CONCURRENT_CSRS: usize = 4;
/// First retry after a failed request to Istio's CA.
const RETRY_FIRST: Duration = Duration::from_millis(500);
/// Longest wait between retries.
const RETRY_MAX: Duration = Duration::from_secs(150);

struct Issued {
    key: Arc<CertifiedKey>,
    /// When we got it; renewal is due at `minted_at + (not_after -
    /// minted_at) / 2` (`not_before` is backdated for clock skew, so it is
    /// not used here).
    minted_at: SystemTime,
    not_before: SystemTime,
    not_after: SystemTime,
}

impl Issued {
    fn renew_at(&self) -> SystemTime {
        self.minted_at
            + self
                .not_after
                .duration_since(self.minted_at)
                .unwrap_or_default()
                / 2
    }
}

/// What the admin dump shows of a certificate (never the key).
#[derive(Debug, Clone, serde::Serialize)]
pub struct CertInfo {
    /// The SPIFFE id.
    pub identity: String,
    /// Start of validity, seconds since the epoch (0: none held yet).
    pub not_before: u64,
    /// End of validity, seconds since the epoch (0: none held yet).
    pub not_after: u64,
    /// Certificates in the chain sent to peers.
    pub chain_length: usize,
    /// `local` or `istio`.
    pub source: &'static str,
    /// The last failed request to the CA for this identity, while it has
    /// not succeeded since.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

enum Source {
    Local(Box<CertificateAuthority>),
    Istio {
        ca: Arc<IstioCa>,
        runtime: tokio::runtime::Handle,
        slots: Arc<tokio::sync::Semaphore>,
    },
}

/// The background request loop of one identity (Istio's CA).
struct Fetcher {
    task: tokio::task::JoinHandle<()>,
    last_error: Option<String>,
}

/// Certificates of the workloads on this node.
pub struct CertManager {
    source: Source,
    lifetime: Duration,
    issued: Mutex<HashMap<Identity, Issued>>,
    fetchers: Mutex<HashMap<Identity, Fetcher>>,
    /// Bumped whenever a certificate is stored or a request fails, to wake
    /// [`CertManager::wait_ready`].
    changed: tokio::sync::watch::Sender<u64>,
    rotations: AtomicU64,
    ca_failures: AtomicU64,
}

impl std::fmt::Debug for CertManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertManager")
            .field("lifetime", &self.lifetime)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl CertManager {
    /// A manager signing with a local `ca`, `lifetime` per certificate.
    pub fn new(ca: CertificateAuthority, lifetime: Duration) -> Self {
        Self::with_source(Source::Local(Box::new(ca)), lifetime)
    }

    /// A manager asking Istio's CA; must be made inside the tokio runtime
    /// its request tasks run on.
    pub fn istio(ca: IstioCa, lifetime: Duration) -> Result<Self, IdentityError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| IdentityError::Ca {
            address: ca.address().to_owned(),
            identity: String::new(),
            message: format!("no async runtime for the CA client: {e}"),
        })?;
        Ok(Self::with_source(
            Source::Istio {
                ca: Arc::new(ca),
                runtime,
                slots: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_CSRS)),
            },
            lifetime,
        ))
    }

    fn with_source(source: Source, lifetime: Duration) -> Self {
        Self {
            source,
            lifetime,
            issued: Mutex::new(HashMap::new()),
            fetchers: Mutex::new(HashMap::new()),
            changed: tokio::sync::watch::Sender::new(0),
            rotations: AtomicU64::new(0),
            ca_failures: AtomicU64::new(0),
        }
    }

    /// Whether certificates come from Istio's CA (no CA key on the node).
    pub fn is_remote(&self) -> bool {
        matches!(self.source, Source::Istio { .. })
    }

    /// The trust anchors peers are verified against.
    pub fn roots(&self) -> rustls::RootCertStore {
        let anchors = match &self.source {
            Source::Local(ca) => ca.roots(),
            Source::Istio { ca, .. } => ca.roots(),
        };
        let mut store = rustls::RootCertStore::empty();
        for root in anchors {
            let _ = store.add(root.clone());
        }
        store
    }

    /// The current certificate of `identity`. Handshakes call this, so a
    /// replacement only affects connections opened afterwards.
    ///
    /// Local CA: issued on first use and replaced once half its lifetime
    /// has passed. Istio's CA: whatever is held and not expired; with none,
    /// the request is started and this fails (the handshake fails closed).
    pub fn certified_key(
        self: &Arc<Self>,
        identity: &Identity,
    ) -> Result<Arc<CertifiedKey>, IdentityError> {
        match &self.source {
            Source::Local(ca) => self.local_key(ca, identity),
            Source::Istio { .. } => {
                if let Some(key) = self.held(identity) {
                    return Ok(key);
                }
                self.prefetch(identity);
                Err(IdentityError::NotYet(identity.to_string()))
            }
        }
    }

    /// Makes sure `identity` gets a certificate without waiting for it:
    /// with Istio's CA, starts its request loop (once); with a local CA,
    /// issues it now. Called when a pod is enrolled.
    pub fn prefetch(self: &Arc<Self>, identity: &Identity) {
        let Source::Istio { ca, runtime, slots } = &self.source else {
            if let Err(e) = self.certified_key(identity) {
                tracing::error!(%identity, error = %e, "cannot issue a certificate");
            }
            return;
        };
        let mut fetchers = lock(&self.fetchers);
        if fetchers.contains_key(identity) {
            return;
        }
        let task = runtime.spawn(request_loop(
            Arc::downgrade(self),
            Arc::clone(ca),
            Arc::clone(slots),
            identity.clone(),
        ));
        fetchers.insert(
            identity.clone(),
            Fetcher {
                task,
                last_error: None,
            },
        );
    }

    /// The certificate of `identity`, waiting at most `limit` for the first
    /// one (Istio's CA); the error says why there is none.
    pub async fn wait_ready(
        self: &Arc<Self>,
        identity: &Identity,
        limit: Duration,
    ) -> Result<Arc<CertifiedKey>, IdentityError> {
        if !self.is_remote() {
            return self.certified_key(identity);
        }
        let mut changed = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(key) = self.held(identity) {
                return Ok(key);
            }
            self.prefetch(identity);
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                let why = lock(&self.fetchers)
                    .get(identity)
                    .and_then(|f| f.last_error.clone())
                    .unwrap_or_else(|| format!("no answer from the CA within {limit:?}"));
                return Err(IdentityError::Unavailable {
                    identity: identity.to_string(),
                    message: why,
                });
            }
        }
    }

    /// A held certificate that has not expired (an expired one is dropped:
    /// presenting it would only fail at the peer).
    fn held(&self, identity: &Identity) -> Option<Arc<CertifiedKey>> {
        let mut issued = lock(&self.issued);
        let current = issued.get(identity)?;
        if SystemTime::now() < current.not_after {
            return Some(Arc::clone(&current.key));
        }
        tracing::error!(%identity, "certificate expired and not renewed: dropped");
        issued.remove(identity);
        None
    }

    fn local_key(
        &self,
        ca: &CertificateAuthority,
        identity: &Identity,
    ) -> Result<Arc<CertifiedKey>, IdentityError> {
        let now = SystemTime::now();
        let mut issued = lock(&self.issued);
        if let Some(current) = issued.get(identity) {
            if now < current.renew_at() {
                return Ok(Arc::clone(&current.key));
            }
            self.rotations.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%identity, "certificate past half-life: rotating");
        }
        let cert = ca.issue(identity, self.lifetime)?;
        let issued_cert = certified(identity, cert, now)?;
        let key = Arc::clone(&issued_cert.key);
        tracing::info!(%identity, lifetime_s = self.lifetime.as_secs(), "issued workload certificate");
        issued.insert(identity.clone(), issued_cert);
        Ok(key)
    }

    /// Stores a certificate from Istio's CA; returns when to renew it.
    fn store(&self, identity: &Identity, cert: WorkloadCert) -> Result<Duration, IdentityError> {
        let now = SystemTime::now();
        let fresh = certified(identity, cert, now)?;
        let renew_in = fresh.renew_at().duration_since(now).unwrap_or_default();
        let lifetime_s = fresh
            .not_after
            .duration_since(now)
            .unwrap_or_default()
            .as_secs();
        let replaced = lock(&self.issued).insert(identity.clone(), fresh).is_some();
        if replaced {
            self.rotations.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%identity, lifetime_s, "certificate renewed by the Istio CA");
        } else {
            tracing::info!(%identity, lifetime_s, "certificate issued by the Istio CA");
        }
        if let Some(f) = lock(&self.fetchers).get_mut(identity) {
            f.last_error = None;
        }
        self.changed.send_modify(|n| *n += 1);
        Ok(renew_in)
    }

    fn failed(&self, identity: &Identity, error: &IdentityError, retry_in: Duration) {
        self.ca_failures.fetch_add(1, Ordering::Relaxed);
        let still_valid = lock(&self.issued).contains_key(identity);
        tracing::warn!(
            %identity,
            %error,
            retry_in_ms = u64::try_from(retry_in.as_millis()).unwrap_or(u64::MAX),
            current_certificate_kept = still_valid,
            "certificate request failed"
        );
        if let Some(f) = lock(&self.fetchers).get_mut(identity) {
            f.last_error = Some(error.to_string());
        }
        self.changed.send_modify(|n| *n += 1);
    }

    /// Certificates held or asked for, for the admin dump.
    pub fn dump(&self) -> Vec<CertInfo> {
        let secs = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        };
        let source = if self.is_remote() { "istio" } else { "local" };
        let issued = lock(&self.issued);
        let fetchers = lock(&self.fetchers);
        let mut out: Vec<CertInfo> = issued
            .iter()
            .map(|(id, i)| CertInfo {
                identity: id.to_string(),
                not_before: secs(i.not_before),
                not_after: secs(i.not_after),
                chain_length: i.key.cert.len(),
                source,
                last_error: fetchers.get(id).and_then(|f| f.last_error.clone()),
            })
            .collect();
        out.extend(
            fetchers
                .iter()
                .filter(|(id, _)| !issued.contains_key(*id))
                .map(|(id, f)| CertInfo {
                    identity: id.to_string(),
                    not_before: 0,
                    not_after: 0,
                    chain_length: 0,
                    source,
                    last_error: f.last_error.clone(),
                }),
        );
        out.sort_by(|a, b| a.identity.cmp(&b.identity));
        out
    }

    /// Drops the certificate of `identity` (no enrolled pod has it any
    /// more) and stops asking for it, so that pods that come and go do not
    /// pile up keys. A pod of that identity enrolled later gets a fresh
    /// one. Returns whether one was held or being asked for.
    pub fn forget(&self, identity: &Identity) -> bool {
        let fetcher = lock(&self.fetchers).remove(identity);
        if let Some(f) = &fetcher {
            f.task.abort();
        }
        lock(&self.issued).remove(identity).is_some() || fetcher.is_some()
    }

    /// How many certificates were replaced because of age.
    pub fn rotations(&self) -> u64 {
        self.rotations.load(Ordering::Relaxed)
    }

    /// How many requests to Istio's CA failed.
    pub fn ca_failures(&self) -> u64 {
        self.ca_failures.load(Ordering::Relaxed)
    }
}

fn certified(
    identity: &Identity,
    cert: WorkloadCert,
    now: SystemTime,
) -> Result<Issued, IdentityError> {
    let signing_key = crate::tls::provider()
        .key_provider
        .load_private_key(cert.key)
        .map_err(|e| IdentityError::Issue {
            identity: identity.to_string(),
            message: e.to_string(),
        })?;
    Ok(Issued {
        key: Arc::new(CertifiedKey::new(cert.chain, signing_key)),
        minted_at: now,
        not_before: cert.not_before,
        not_after: cert.not_after,
    })
}

/// Asks Istio's CA for `identity`'s certificate, then again at each
/// half-life, until the manager forgets the identity (which aborts this
/// task) or is dropped.
async fn request_loop(
    manager: Weak<CertManager>,
    ca: Arc<IstioCa>,
    slots: Arc<tokio::sync::Semaphore>,
    identity: Identity,
) {
    let mut backoff = RETRY_FIRST;
    loop {
        let result = {
            // The semaphore is never closed; a failed acquire only means
            // the manager is going away.
            let Ok(_slot) = slots.acquire().await else {
                return;
            };
            ca.fetch(&identity).await
        };
        let Some(manager) = manager.upgrade() else {
            return;
        };
        let wait = match result.and_then(|cert| manager.store(&identity, cert)) {
            Ok(renew_in) => {
                backoff = RETRY_FIRST;
                renew_in
            }
            Err(e) => {
                let wait = backoff;
                backoff = (backoff * 2).min(RETRY_MAX);
                manager.failed(&identity, &e, wait);
                wait
            }
        };
        drop(manager);
        tokio::time::sleep(wait).await;
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
        let short = Arc::new(CertManager::new(ca, Duration::from_secs(1)));
        let id = Identity::new("cluster.local", "demo", "a1");
        let a = short.certified_key(&id).expect("issue");
        assert!(Arc::ptr_eq(&a, &short.certified_key(&id).expect("cached")));
        std::thread::sleep(Duration::from_millis(600));
        let b = short.certified_key(&id).expect("rotate");
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(short.rotations(), 1);

        let ca = CertificateAuthority::development(&dir, "cluster.local").expect("ca");
        let long = Arc::new(CertManager::new(ca, DEFAULT_LIFETIME));
        let a = long.certified_key(&id).expect("issue");
        let b = long.certified_key(&id).expect("cached");
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(long.dump().len(), 1);
        assert_eq!(long.dump()[0].source, "local");
        assert!(long.forget(&id));
        assert!(long.dump().is_empty());
        assert!(!long.forget(&id));
        let c = long.certified_key(&id).expect("issued again");
        assert!(!Arc::ptr_eq(&a, &c));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
