//! Rate-limited log lines.
//!
//! Some events come in floods: a pod at its connection limit refuses every
//! new connection, a listener out of file descriptors fails every accept.
//! One warning per event would bury everything else in the log (and cost
//! more than the refusal itself), so such warnings go through a
//! [`LogThrottle`]: at most one line per interval, which says how many
//! were left out since the last one. The exact numbers are in the
//! counters, never in the log.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

/// How often a throttled warning may be written. Ten seconds: a human
/// reading the log sees that the condition persists, and a flood costs six
/// lines a minute per source.
pub const DEFAULT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Lets one log line through per interval and counts the others.
#[derive(Debug)]
pub struct LogThrottle {
    interval: Duration,
    /// When the last line was written, and how many were held back since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Default for LogThrottle {
    fn default() -> Self {
        Self::new(DEFAULT_LOG_INTERVAL)
    }
}

impl LogThrottle {
    /// A throttle letting one line through per `interval`.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(suppressed)` when a line may be written now (`suppressed`:
    /// how many were held back since the last one), `None` otherwise.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let due = state
            .0
            .is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if due {
            let suppressed = state.1;
            *state = (Some(now), 0);
            Some(suppressed)
        } else {
            state.1 += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_and_the_rest_counted() {
        let throttle = LogThrottle::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(throttle.allow_at(t0), Some(0));
        for i in 1..=5 {
            assert_eq!(throttle.allow_at(t0 + Duration::from_secs(i)), None);
        }
        assert_eq!(throttle.allow_at(t0 + Duration::from_secs(10)), Some(5));
        assert_eq!(throttle.allow_at(t0 + Duration::from_secs(11)), None);
        assert_eq!(throttle.allow_at(t0 + Duration::from_secs(25)), Some(1));
    }
}
