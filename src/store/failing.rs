//! Work of the ledger's threads that fails and is tried again until it
//! succeeds (the log's appends, the applier's work in sled): what fails,
//! since when and how often, for `/readyz`, refusals and the log lines.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// A piece of the ledger's work has been failing since `since`.
#[derive(Clone, Debug)]
pub struct Failure {
    /// What cannot be done, as the start of a sentence.
    pub what: &'static str,
    /// The last attempt's error.
    pub error: String,
    /// When the first of these failures happened.
    pub since: Instant,
    /// Failed attempts since then.
    pub attempts: u32,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} ({} failed attempts over {} s)",
            self.what,
            self.error,
            self.attempts,
            self.since.elapsed().as_secs()
        )
    }
}

/// Whether one piece of retried work is failing now.
#[derive(Default)]
pub struct Failing {
    /// Set while it fails, changed only under `failure`'s lock; read on
    /// every send, so an atomic.
    failing: AtomicBool,
    /// What is failing, while `failing` is set.
    failure: Mutex<Option<Failure>>,
}

impl Failing {
    /// An attempt failed with `error`; returns the attempts since the
    /// failures began and whether the error changed (a new one included).
    pub fn failed(&self, what: &'static str, error: String) -> (u32, bool) {
        let mut failure = self.failure.lock().expect("failure lock");
        let failure = failure.get_or_insert_with(|| Failure {
            what,
            error: String::new(),
            since: Instant::now(),
            attempts: 0,
        });
        let changed = failure.error != error;
        failure.error = error;
        failure.attempts += 1;
        self.failing.store(true, Ordering::Relaxed);
        (failure.attempts, changed)
    }

    /// An attempt succeeded: the failure it ends, if attempts were failing.
    pub fn recovered(&self) -> Option<Failure> {
        // Most calls find nothing failing, and take no lock.
        if !self.failing.load(Ordering::Relaxed) {
            return None;
        }
        // The flag changes under the lock, as in `failed`, so that a waiter
        // never sees it set with no failure recorded.
        let mut failure = self.failure.lock().expect("failure lock");
        self.failing.store(false, Ordering::Relaxed);
        failure.take()
    }

    /// Whether attempts fail now.
    pub fn is_failing(&self) -> bool {
        self.failing.load(Ordering::Relaxed)
    }

    /// What is failing, while attempts fail.
    pub fn failure(&self) -> Option<Failure> {
        if !self.failing.load(Ordering::Relaxed) {
            return None;
        }
        self.failure.lock().expect("failure lock").clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_counts_its_attempts_until_one_succeeds() {
        let failing = Failing::default();
        assert!(failing.failure().is_none());
        assert_eq!(
            failing.failed("the work fails", "disk full".into()),
            (1, true)
        );
        assert_eq!(
            failing.failed("the work fails", "disk full".into()),
            (2, false)
        );
        assert_eq!(
            failing.failed("the work fails", "I/O error".into()),
            (3, true)
        );
        let failure = failing.failure().expect("failing");
        assert!(
            failure
                .to_string()
                .starts_with("the work fails: I/O error (3 failed attempts"),
            "{failure}"
        );
        assert_eq!(failing.recovered().map(|f| f.attempts), Some(3));
        assert!(failing.failure().is_none());
        assert!(failing.recovered().is_none(), "recovered once");
    }
}
