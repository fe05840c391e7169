//! The open inbound connections of this node, so that a policy change
//! reaches them too.
//!
//! Authorization is checked where a connection arrives: the HBONE server
//! (15008), the plaintext inbound listener (15006) and the same-node fast
//! path. Checking only when a connection opens would let a DENY added to
//! stop a compromised workload leave every connection it already holds
//! running for as long as it likes (hours, for a database connection), so,
//! like Istio's ztunnel, we close open connections that a new state no
//! longer allows.
//!
//! Each such connection registers what the check needs
//! ([`InboundConnection`]) and gets a [`Registration`], which it races its
//! copy loop against ([`Registration::unless_revoked`]). After the mesh
//! state is replaced, [`OpenConnections::enforce`] runs the same check as at
//! open on every entry and revokes those now denied: their copy loop is
//! dropped, which closes both sockets (an HBONE stream is reset). The
//! registration is an RAII guard: a connection leaves the registry when its
//! task ends, however it ends, so the registry never grows beyond what is
//! open.
//!
//! Ordering: a connection registers *before* it reads the state for its
//! open-time check, and `enforce` runs *after* the new state is published.
//! So either the open-time check already sees the new state, or the entry
//! is in the registry when `enforce` walks it: no connection authorized by
//! the old state escapes both.

use std::{
    collections::HashMap,
    future::Future,
    io,
    net::SocketAddr,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use tokio::sync::oneshot;

use crate::{
    identity::Identity,
    state::{MeshState, policy::Peer},
    telemetry::Metrics,
};

/// What the authorization check of an open inbound connection needs.
#[derive(Debug, Clone)]
pub struct InboundConnection {
    /// The destination pod (enrolled on this node).
    pub pod: String,
    /// Its identity.
    pub pod_identity: Identity,
    /// The client's verified identity; `None` for plaintext.
    pub peer_identity: Option<Identity>,
    /// The client's address.
    pub src: SocketAddr,
    /// The destination address (the port is what policies match).
    pub dst: SocketAddr,
    /// `hbone`, `plaintext` or `local`, for the log line.
    pub path: &'static str,
}

impl InboundConnection {
    /// The same check as at open, against `state`: `Err((policy label,
    /// reason))` when `state` denies the connection.
    fn authorize(&self, state: &MeshState) -> Result<(), (String, String)> {
        let peer = Peer {
            identity: self.peer_identity.as_ref(),
            ip: self.src.ip(),
        };
        state.authorize_inbound(&self.pod, &peer, self.dst.port())
    }
}

struct Entry {
    connection: InboundConnection,
    revoke: oneshot::Sender<String>,
}

/// The registry of open inbound connections.
#[derive(Default)]
pub struct OpenConnections {
    entries: Mutex<HashMap<u64, Entry>>,
    next: AtomicU64,
}

impl std::fmt::Debug for OpenConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenConnections")
            .field("open", &self.len())
            .finish()
    }
}

impl OpenConnections {
    /// Registers `connection` until the returned guard is dropped. Call it
    /// before reading the state for the open-time check (see the module
    /// documentation for why).
    pub fn register(self: &Arc<Self>, connection: InboundConnection) -> Registration {
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        let (revoke, revoked) = oneshot::channel();
        self.lock().insert(key, Entry { connection, revoke });
        Registration {
            registry: Arc::clone(self),
            key,
            revoked,
        }
    }

    /// Open connections right now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no connection is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Re-checks every open connection against `state` and closes those it
    /// denies: one log line and one count per connection. Returns how many
    /// were closed.
    pub fn enforce(&self, state: &MeshState, metrics: &Metrics) -> usize {
        let revoked: Vec<(u64, Entry, String, String)> = {
            let mut entries = self.lock();
            let denied: Vec<(u64, String, String)> = entries
                .iter()
                .filter_map(|(key, e)| {
                    e.connection
                        .authorize(state)
                        .err()
                        .map(|(policy, reason)| (*key, policy, reason))
                })
                .collect();
            denied
                .into_iter()
                .filter_map(|(key, policy, reason)| {
                    entries
                        .remove(&key)
                        .map(|entry| (key, entry, policy, reason))
                })
                .collect()
        };
        let closed = revoked.len();
        for (key, entry, policy, reason) in revoked {
            let c = &entry.connection;
            tracing::info!(
                conn = key,
                pod = %c.pod,
                src = %c.src,
                src_identity = %c.peer_identity.as_ref().map_or_else(|| "none (plaintext)".to_owned(), ToString::to_string),
                dst = %c.dst,
                path = c.path,
                %policy,
                %reason,
                "open connection closed: the new policy denies it"
            );
            metrics.closed_by_policy(&policy);
            // The connection may have ended on its own in the meantime; then
            // nobody listens and there is nothing left to close.
            let _ = entry.revoke.send(reason);
        }
        closed
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One registered connection; dropping it deregisters the connection.
#[derive(Debug)]
pub struct Registration {
    registry: Arc<OpenConnections>,
    key: u64,
    revoked: oneshot::Receiver<String>,
}

impl Registration {
    /// Runs `work` (the connection's copy loop) until it finishes or the
    /// connection is revoked; a revocation drops `work`, which closes its
    /// sockets, and is returned as a `ConnectionAborted` error naming the
    /// reason. Consumes the registration: the connection is over either way.
    pub async fn unless_revoked<T>(
        mut self,
        work: impl Future<Output = io::Result<T>>,
    ) -> io::Result<T> {
        let work = std::pin::pin!(work);
        tokio::select! {
            // A revocation that arrived before the copy started wins.
            biased;
            Ok(reason) = &mut self.revoked => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                format!("closed by policy: {reason}"),
            )),
            result = work => result,
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::state::local::parse;

    const MESH: &str = "
workloads:
  - {uid: web, name: web, namespace: demo, serviceAccount: web, node: n, ips: [10.0.0.2]}
";

    fn state(extra: &str) -> MeshState {
        MeshState::new(parse(&format!("{MESH}{extra}"), std::path::Path::new("t")).expect("valid"))
    }

    fn connection(client_sa: Option<&str>, port: u16) -> InboundConnection {
        InboundConnection {
            pod: "web".into(),
            pod_identity: Identity::new("cluster.local", "demo", "web"),
            peer_identity: client_sa.map(|sa| Identity::new("cluster.local", "demo", sa)),
            src: "10.0.0.1:40000".parse().expect("addr"),
            dst: SocketAddr::from(([10, 0, 0, 2], port)),
            path: "hbone",
        }
    }

    const DENY_A: &str = "policies:\n  - {name: no-a, namespace: demo, action: DENY, rules: [{from: [{principals: [\"spiffe://cluster.local/ns/demo/sa/a\"]}]}]}\n";

    #[test]
    fn registrations_leave_when_dropped() {
        let registry = Arc::new(OpenConnections::default());
        let one = registry.register(connection(Some("a"), 80));
        let two = registry.register(connection(None, 80));
        assert_eq!(registry.len(), 2);
        drop(one);
        assert_eq!(registry.len(), 1, "a dropped registration must leave");
        drop(two);
        assert!(registry.is_empty(), "registry must not grow");
    }

    #[test]
    fn only_connections_the_new_state_denies_are_closed_and_counted() {
        let registry = Arc::new(OpenConnections::default());
        let metrics = Metrics::new();
        let denied = registry.register(connection(Some("a"), 80));
        let allowed = registry.register(connection(Some("b"), 80));
        assert_eq!(
            registry.enforce(&state(""), &metrics),
            0,
            "no policy: nothing closed"
        );
        assert_eq!(registry.enforce(&state(DENY_A), &metrics), 1);
        assert_eq!(registry.len(), 1, "the revoked connection leaves at once");
        let text = metrics.encode();
        assert!(
            text.contains("ztunnel_connections_closed_by_policy_total{policy=\"demo/no-a\"} 1"),
            "{text}"
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let pending = std::future::pending::<io::Result<()>>();
        let err = runtime
            .block_on(denied.unless_revoked(pending))
            .expect_err("a revoked connection must stop");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        assert!(err.to_string().contains("demo/no-a"), "{err}");
        // The allowed one keeps running until its work is done.
        let finished = runtime.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(5),
                allowed.unless_revoked(async { Ok(7) }),
            )
            .await
        });
        assert_eq!(finished.expect("not revoked").expect("work result"), 7);
        assert!(registry.is_empty());
    }

    #[test]
    fn strict_mtls_closes_open_plaintext_connections() {
        let registry = Arc::new(OpenConnections::default());
        let metrics = Metrics::new();
        let _plain = registry.register(InboundConnection {
            path: "plaintext",
            ..connection(None, 80)
        });
        let _mtls = registry.register(connection(Some("a"), 80));
        let strict = "peerAuthentications:\n  - {namespace: demo, mode: STRICT}\n";
        assert_eq!(registry.enforce(&state(strict), &metrics), 1);
        assert!(
            metrics
                .encode()
                .contains("ztunnel_connections_closed_by_policy_total{policy=\"mtls_strict\"} 1")
        );
    }
}
