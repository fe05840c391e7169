//! The one accept loop every listener uses: the pods' 15001, 15006, 15008
//! and 15080, the admin, metrics and readiness servers (and, through
//! [`Backoff`] and [`AcceptErrorKind`], the enrolment socket's thread).
//!
//! Why a shared loop: `accept()` fails for two kinds of reasons. Some are
//! about one connection (it was reset while queued; Linux also reports
//! pending network errors of the new socket here): the next accept works,
//! so the loop goes on at once. Others are about us: out of file
//! descriptors (`EMFILE`, `ENFILE`) or memory. The queued connection stays
//! queued and the listener stays readable, so retrying at once spins a
//! core at 100% and writes a warning per spin, which is what every loop
//! did before. Here such an error waits a [`Backoff`] (5 ms doubling to
//! 1 s, back to 5 ms after the next success), is counted in
//! `ztunnel_accept_errors_total{listener,kind}` and logged at most once per
//! ten seconds per listener.
//!
//! A pod's listeners also admit each connection against the pod's and the
//! node's connection limits (`crate::limits`), and the admin, metrics and
//! readiness servers against a fixed limit each, before anything is
//! spawned for it; the permit lives as long as the connection's task.

use std::{future::Future, io, net::SocketAddr, sync::Arc, time::Duration};

use tokio::net::{TcpListener, TcpStream};

use crate::{
    limits::{
        ADMIN_CONNECTIONS_PER_LISTENER, ConnectionPermit, ListenerLimit, PodLimit, Side, Slot,
    },
    telemetry::{Metrics, throttle::LogThrottle},
};

/// First wait after a resource error. Short: a burst of closing
/// connections usually frees descriptors within milliseconds.
pub const BACKOFF_START: Duration = Duration::from_millis(5);
/// Longest wait. One second keeps a listener that is out of descriptors
/// near 0% CPU and still picks up within a second once they come back.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Waits that double after each failure and start over after a success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            next: BACKOFF_START,
        }
    }
}

impl Backoff {
    /// The wait after one more failure.
    pub fn failed(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(BACKOFF_MAX);
        wait
    }

    /// A success: the next failure waits [`BACKOFF_START`] again.
    pub fn succeeded(&mut self) {
        self.next = BACKOFF_START;
    }
}

/// What an `accept()` error was about (the `kind` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptErrorKind {
    /// One queued connection failed (reset, or a network error Linux
    /// passes on from the new socket): retried at once.
    Connection,
    /// The process is out of file descriptors (`EMFILE`).
    ProcessFdLimit,
    /// The system is out of file descriptors (`ENFILE`).
    SystemFdLimit,
    /// Out of memory or socket buffers (`ENOMEM`, `ENOBUFS`).
    Memory,
    /// Anything else; backed off like a resource error, since we do not
    /// know that retrying at once helps.
    Other,
}

impl AcceptErrorKind {
    /// Classifies an OS error number.
    pub fn of_errno(errno: Option<i32>) -> Self {
        match errno {
            Some(
                libc::ECONNABORTED
                | libc::ECONNRESET
                | libc::EPROTO
                | libc::ENETDOWN
                | libc::ENOPROTOOPT
                | libc::EHOSTDOWN
                | libc::ENONET
                | libc::EHOSTUNREACH
                | libc::EOPNOTSUPP
                | libc::ENETUNREACH
                | libc::EINTR,
            ) => Self::Connection,
            Some(libc::EMFILE) => Self::ProcessFdLimit,
            Some(libc::ENFILE) => Self::SystemFdLimit,
            Some(libc::ENOMEM | libc::ENOBUFS) => Self::Memory,
            _ => Self::Other,
        }
    }

    /// Classifies an I/O error.
    pub fn of(error: &io::Error) -> Self {
        Self::of_errno(error.raw_os_error())
    }

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connection => "connection",
            Self::ProcessFdLimit => "process_fd_limit",
            Self::SystemFdLimit => "system_fd_limit",
            Self::Memory => "memory",
            Self::Other => "other",
        }
    }

    /// Whether the loop waits before the next accept.
    pub fn backs_off(self) -> bool {
        self != Self::Connection
    }
}

/// Which listener (the `listener` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerKind {
    /// A pod's 15001.
    Outbound,
    /// A pod's 15006.
    InboundPlaintext,
    /// A pod's 15008.
    Hbone,
    /// A pod's 15080.
    Socks5,
    /// 15000.
    Admin,
    /// 15020.
    Metrics,
    /// 15021.
    Readiness,
    /// The enrolment socket.
    Enrolment,
}

impl ListenerKind {
    /// Which of its pod's counts a connection on this listener takes.
    fn side(self) -> Side {
        match self {
            Self::Outbound | Self::Socks5 => Side::Outbound,
            // Only pods' listeners have a side; the node's have their own
            // limits.
            _ => Side::Inbound,
        }
    }

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Outbound => "outbound",
            Self::InboundPlaintext => "inbound_plaintext",
            Self::Hbone => "hbone",
            Self::Socks5 => "socks5",
            Self::Admin => "admin",
            Self::Metrics => "metrics",
            Self::Readiness => "readiness",
            Self::Enrolment => "enrolment",
        }
    }
}

/// Counts, logs (throttled) and classifies one failed accept; the caller
/// waits `Some(duration)` before the next one.
#[derive(Debug)]
pub struct AcceptErrors {
    listener: ListenerKind,
    pod: Option<String>,
    metrics: Arc<Metrics>,
    backoff: Backoff,
    log: LogThrottle,
}

impl AcceptErrors {
    /// For `listener` (of `pod`, when it is a pod's).
    pub fn new(listener: ListenerKind, pod: Option<String>, metrics: Arc<Metrics>) -> Self {
        Self {
            listener,
            pod,
            metrics,
            backoff: Backoff::default(),
            log: LogThrottle::default(),
        }
    }

    /// An accept worked.
    pub fn succeeded(&mut self) {
        self.backoff.succeeded();
    }

    /// An accept failed with `errno`: counted, logged (at most once per
    /// interval), and the wait before the next one returned (`None`: go
    /// on at once).
    pub fn failed(
        &mut self,
        errno: Option<i32>,
        error: &dyn std::fmt::Display,
    ) -> Option<Duration> {
        let kind = AcceptErrorKind::of_errno(errno);
        self.metrics
            .accept_failed(self.listener.as_str(), kind.as_str());
        let wait = kind.backs_off().then(|| self.backoff.failed());
        if !kind.backs_off() {
            tracing::debug!(listener = self.listener.as_str(), pod = self.pod.as_deref().unwrap_or("-"), %error, "accept: one connection failed");
        } else if let Some(suppressed) = self.log.allow() {
            tracing::warn!(
                listener = self.listener.as_str(),
                pod = self.pod.as_deref().unwrap_or("-"),
                kind = kind.as_str(),
                %error,
                wait_ms = wait.unwrap_or_default().as_millis() as u64,
                suppressed,
                "accept failed: backing off"
            );
        }
        wait
    }
}

/// The accept loop of one listener.
#[derive(Debug)]
pub struct AcceptLoop {
    errors: AcceptErrors,
    limit: Admission,
}

/// What a new connection is admitted against.
#[derive(Debug)]
enum Admission {
    /// Its pod's and the node's connection limits.
    Pod(Arc<PodLimit>, Side),
    /// The listener's own limit (admin, metrics, readiness).
    Listener(ListenerLimit),
}

/// Held by a connection's task: its place under the limit, given back
/// when the task ends (the fields are only there to be dropped).
#[derive(Debug)]
#[allow(dead_code, reason = "held for their Drop, never read")]
enum Permit {
    Pod(ConnectionPermit),
    Listener(Slot),
}

impl AcceptLoop {
    /// For a node listener (admin, metrics, readiness): at most
    /// [`ADMIN_CONNECTIONS_PER_LISTENER`] open connections.
    pub fn node(listener: ListenerKind, metrics: Arc<Metrics>) -> Self {
        let limit = ListenerLimit::new(
            listener.as_str(),
            ADMIN_CONNECTIONS_PER_LISTENER,
            Arc::clone(&metrics),
        );
        Self {
            errors: AcceptErrors::new(listener, None, metrics),
            limit: Admission::Listener(limit),
        }
    }

    /// For one of a pod's listeners: connections count against `limit`.
    pub fn pod(listener: ListenerKind, limit: Arc<PodLimit>, metrics: Arc<Metrics>) -> Self {
        Self {
            errors: AcceptErrors::new(listener, Some(limit.uid().to_owned()), metrics),
            limit: Admission::Pod(limit, listener.side()),
        }
    }

    /// Accepts forever (until the task is aborted). Each connection over
    /// its limit is reset at once; each other one is
    /// passed to `handle`, and the future it returns (if any) is spawned
    /// holding the connection's permit.
    pub async fn run<H, F>(mut self, listener: TcpListener, mut handle: H)
    where
        H: FnMut(TcpStream, SocketAddr) -> Option<F>,
        F: Future<Output = ()> + Send + 'static,
    {
        // No span around the loop: each connection's span (made by
        // `handle`) would become its child and every connection's log line
        // would grow; the loop's own warnings name listener and pod.
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => {
                    self.errors.succeeded();
                    accepted
                }
                Err(e) => {
                    if let Some(wait) = self.errors.failed(e.raw_os_error(), &e) {
                        tokio::time::sleep(wait).await;
                    }
                    continue;
                }
            };
            let permit = match &self.limit {
                Admission::Pod(limit, side) => limit.admit(*side).map(Permit::Pod),
                Admission::Listener(limit) => limit.admit().map(Permit::Listener),
            };
            // Over the limit (counted and logged by the limit): reset, so
            // the client learns at once that it was refused rather than
            // seeing what looks like its server closing; the same signal
            // a refused upstream gives (`proxy::outbound::handle`).
            let Some(permit) = permit else {
                let _ = stream.set_zero_linger();
                continue;
            };
            if let Some(work) = handle(stream, peer) {
                tokio::spawn(Holding {
                    work,
                    _permit: permit,
                });
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// A connection's work and its permit, as one future. Not an `async`
    /// block that awaits `work`: such a block keeps the captured future and
    /// the one it awaits in separate slots, doubling every connection's
    /// task (measured: +3.1 KiB per idle outbound connection).
    struct Holding<F> {
        #[pin]
        work: F,
        _permit: Permit,
    }
}

impl<F: Future<Output = ()>> Future for Holding<F> {
    type Output = ();

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        self.project().work.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_second_and_starts_over_after_a_success() {
        let mut b = Backoff::default();
        let waits: Vec<u64> = (0..10).map(|_| b.failed().as_millis() as u64).collect();
        assert_eq!(waits, [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        b.succeeded();
        assert_eq!(b.failed(), BACKOFF_START);
    }

    #[test]
    fn resource_errors_back_off_and_connection_errors_do_not() {
        let metrics = Metrics::new();
        let mut errors =
            AcceptErrors::new(ListenerKind::Hbone, Some("p".into()), Arc::clone(&metrics));
        let e = io::Error::from_raw_os_error(libc::EMFILE);
        assert_eq!(errors.failed(Some(libc::EMFILE), &e), Some(BACKOFF_START));
        assert_eq!(
            errors.failed(Some(libc::EMFILE), &e),
            Some(BACKOFF_START * 2)
        );
        assert_eq!(errors.failed(Some(libc::ECONNABORTED), &e), None);
        errors.succeeded();
        assert_eq!(errors.failed(Some(libc::ENFILE), &e), Some(BACKOFF_START));
        let text = metrics.encode();
        for line in [
            "ztunnel_accept_errors_total{listener=\"hbone\",kind=\"process_fd_limit\"} 2",
            "ztunnel_accept_errors_total{listener=\"hbone\",kind=\"connection\"} 1",
            "ztunnel_accept_errors_total{listener=\"hbone\",kind=\"system_fd_limit\"} 1",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }
}
