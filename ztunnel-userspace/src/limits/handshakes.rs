//! HBONE connections still in their handshakes (TLS, then HTTP/2): the
//! cheapest connections to open (a client needs no certificate to start
//! one) and the only ones that carry nothing yet, so under node pressure
//! they are the first to go.
//!
//! Each holds a place in its pod's share (`--max-pod-hbone-handshakes`)
//! and in the node's places (`--max-hbone-handshakes`), booked here in the
//! order they arrived. Two pressures evict:
//! - the node's handshake places are all taken: a new handshake to a pod
//!   takes the oldest place of the largest holder, if that leaves the
//!   holder at least as many places as the newcomer's pod. A flood of
//!   silent connections spread over several pods (each within its share)
//!   then cannot keep another pod's peers out, and a pod that is itself
//!   (nearly) the largest holder is refused as before, so neither a flood
//!   nor two busy pods churn each other's handshakes away.
//! - the node's open connections are all taken
//!   (`--max-connections-per-node`): a new connection of any kind closes
//!   the oldest handshake of the largest holder and takes its place.
//!
//! An evicted connection is closed at once (its task is told through a
//! channel, and [`HandshakePlace::run`] ends the handshake), counted in
//! `ztunnel_pod_handshakes_evicted_total{pod,limit}` and logged.

use std::{
    collections::{BTreeMap, HashMap},
    future::Future,
    sync::Arc,
};

use tokio::sync::oneshot;

use super::{Limit, PodLimit, Slot};
use crate::telemetry::Metrics;

/// The handshakes in progress on the node, by pod, oldest first.
#[derive(Debug, Default)]
pub(super) struct Book {
    /// Arrival number of the next handshake (orders each pod's places).
    next: u64,
    pods: HashMap<String, BTreeMap<u64, Pending>>,
}

/// One booked handshake: how to tell its connection to close, and its
/// place among the node's.
#[derive(Debug)]
struct Pending {
    evict: oneshot::Sender<()>,
    node: Slot,
}

impl Book {
    /// Places pod `pod` holds.
    pub(super) fn held(&self, pod: &str) -> usize {
        self.pods.get(pod).map_or(0, BTreeMap::len)
    }

    /// The pod holding the most places, and how many (ties: any of them).
    fn largest(&self) -> Option<(&str, usize)> {
        self.pods
            .iter()
            .map(|(pod, places)| (pod.as_str(), places.len()))
            .max_by_key(|(_, held)| *held)
    }

    /// Books a handshake of `pod` holding `node`; returns its number and
    /// the receiver its connection watches for eviction.
    pub(super) fn book(&mut self, pod: &str, node: Slot) -> (u64, oneshot::Receiver<()>) {
        let (evict, evicted) = oneshot::channel();
        let number = self.next;
        self.next += 1;
        self.pods
            .entry(pod.to_owned())
            .or_default()
            .insert(number, Pending { evict, node });
        (number, evicted)
    }

    /// Gives back handshake `number` of `pod`, unless it was evicted.
    fn give_back(&mut self, pod: &str, number: u64) {
        if let Some(places) = self.pods.get_mut(pod) {
            places.remove(&number);
            if places.is_empty() {
                self.pods.remove(pod);
            }
        }
    }

    /// Evicts the oldest handshake of the largest holder, if it holds
    /// more than `more_than` places: tells its connection to close, counts
    /// it under `pressure`, and returns its node place (for the caller to
    /// take over or drop).
    pub(super) fn evict_largest(
        &mut self,
        more_than: usize,
        pressure: Limit,
        metrics: &Metrics,
    ) -> Option<(String, Slot)> {
        let (victim, held) = self.largest()?;
        if held <= more_than {
            return None;
        }
        let victim = victim.to_owned();
        let places = self.pods.get_mut(&victim)?;
        let (_, oldest) = places.pop_first()?;
        if places.is_empty() {
            self.pods.remove(&victim);
        }
        // A connection that already ended has dropped its receiver; its
        // place is taken over all the same.
        let _ = oldest.evict.send(());
        metrics.pod_handshake_evicted(&victim, pressure.as_str());
        Some((victim, oldest.node))
    }
}

/// One HBONE handshake in progress: counted against its pod and the node
/// until dropped, or until evicted under node pressure.
#[derive(Debug)]
pub struct HandshakePlace {
    pub(super) pod: Arc<PodLimit>,
    pub(super) number: u64,
    pub(super) evicted: oneshot::Receiver<()>,
}

/// The handshake's place was taken by another connection under node
/// pressure (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "evicted: the node's places were full and this handshake was the oldest of the largest holder"
)]
pub struct Evicted;

impl HandshakePlace {
    /// Runs `handshake` in this place: its output, or [`Evicted`] (with
    /// `handshake` dropped, which closes its connection) if the place is
    /// taken first. The place is given back either way.
    pub async fn run<F: Future>(mut self, handshake: F) -> Result<F::Output, Evicted> {
        tokio::select! {
            out = handshake => Ok(out),
            // Only an eviction sends; the sender is otherwise dropped only
            // by this place's own `Drop`.
            _ = &mut self.evicted => Err(Evicted),
        }
    }
}

impl Drop for HandshakePlace {
    fn drop(&mut self) {
        self.pod.node.book().give_back(&self.pod.uid, self.number);
    }
}
