//! Undoing a half-done enrolment.
//!
//! An enrolment changes the pod's namespace (iptables rules, reply
//! routing) and the kernel (listener entries, `sk_lookup` and TC links, the
//! `POD_CAPTURE` entry) in several steps, any of which can fail. Each step
//! that succeeds records how to undo itself; when a later one fails, the
//! recorded steps are undone newest first, so a failed enrolment leaves the
//! pod exactly as it found it.

/// One recorded undo step: what it undoes, and how.
type Step<'a> = (&'static str, Box<dyn FnOnce() -> Result<(), String> + 'a>);

/// The undo steps of one enrolment in progress.
pub struct Rollback<'a> {
    pod: String,
    steps: Vec<Step<'a>>,
}

impl<'a> Rollback<'a> {
    /// An empty record for pod `pod`.
    pub fn new(pod: &str) -> Self {
        Self {
            pod: pod.to_owned(),
            steps: Vec::new(),
        }
    }

    /// Records how to undo `what`, which has just been done.
    pub fn push(&mut self, what: &'static str, undo: impl FnOnce() -> Result<(), String> + 'a) {
        self.steps.push((what, Box::new(undo)));
    }

    /// Undoes every recorded step, newest first. A step that cannot be
    /// undone is logged and the others still run. Returns the names of the
    /// steps undone.
    pub fn run(self) -> Vec<&'static str> {
        let mut undone = Vec::with_capacity(self.steps.len());
        for (what, undo) in self.steps.into_iter().rev() {
            match undo() {
                Ok(()) => undone.push(what),
                Err(e) => {
                    tracing::error!(pod = %self.pod, step = what, error = %e, "could not undo a step of a failed enrolment");
                }
            }
        }
        undone
    }
}

impl std::fmt::Debug for Rollback<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let steps: Vec<&str> = self.steps.iter().map(|(what, _)| *what).collect();
        f.debug_struct("Rollback")
            .field("pod", &self.pod)
            .field("steps", &steps)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::{cell::RefCell, rc::Rc};

    use super::*;

    #[test]
    fn undoes_newest_first_and_keeps_going_after_a_failure() {
        let log = Rc::new(RefCell::new(Vec::new()));
        let mut rollback = Rollback::new("p1");
        for (what, ok) in [("first", true), ("second", false), ("third", true)] {
            let log = Rc::clone(&log);
            rollback.push(what, move || {
                log.borrow_mut().push(what);
                if ok { Ok(()) } else { Err("busy".into()) }
            });
        }
        assert_eq!(rollback.run(), vec!["third", "first"]);
        assert_eq!(*log.borrow(), vec!["third", "second", "first"]);
    }
}
