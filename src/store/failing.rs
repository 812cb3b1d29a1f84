//! Work of the ledger's threads that fails and is tried again until it
//! succeeds (the log's appends, the applier's work in sled): what fails,
//! since when and how often, for `/readyz`, refusals, metrics and the log
//! lines; and the faults tests inject into that work.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// Failed attempts since the ledger opened, for `GET /metrics`.
    attempts_total: AtomicU64,
}

impl Failing {
    /// An attempt failed with `error`; returns the attempts since the
    /// failures began and whether the error changed (a new one included).
    /// Logged when the failures start or their error changes, then every
    /// 100 attempts (a full disk fails one ten times a second).
    pub fn failed(&self, what: &'static str, error: String) -> (u32, bool) {
        self.attempts_total.fetch_add(1, Ordering::Relaxed);
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
        if changed || failure.attempts % 100 == 0 {
            tracing::error!(error = %failure.error, attempts = failure.attempts, "{what}; retrying");
        }
        (failure.attempts, changed)
    }

    /// An attempt succeeded: the failure it ends (and logs), if attempts
    /// were failing.
    pub fn recovered(&self) -> Option<Failure> {
        // Most calls find nothing failing, and take no lock.
        if !self.failing.load(Ordering::Relaxed) {
            return None;
        }
        // The flag changes under the lock, as in `failed`, so that a waiter
        // never sees it set with no failure recorded.
        let mut failure = self.failure.lock().expect("failure lock");
        self.failing.store(false, Ordering::Relaxed);
        let ended = failure.take();
        if let Some(ended) = &ended {
            tracing::info!(
                attempts = ended.attempts,
                seconds = ended.since.elapsed().as_secs_f64(),
                failed = ended.what,
                "ledger work succeeds again"
            );
        }
        ended
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

    /// Failed attempts since the ledger opened.
    pub fn attempts_total(&self) -> u64 {
        self.attempts_total.load(Ordering::Relaxed)
    }
}

/// Where tests make a piece of the ledger's work fail; outside tests it
/// holds nothing and never fails.
#[derive(Default)]
pub struct InjectedFault {
    #[cfg(test)]
    kind: Mutex<Option<std::io::ErrorKind>>,
}

impl InjectedFault {
    /// The fault a test injected, as the work's I/O error.
    pub fn check(&self) -> std::io::Result<()> {
        #[cfg(test)]
        if let Some(kind) = *self.kind.lock().expect("fault lock") {
            return Err(std::io::Error::new(kind, "injected by a test"));
        }
        Ok(())
    }

    /// Makes the work fail with `kind` until the guard is dropped.
    #[cfg(test)]
    pub(crate) fn inject(self: &std::sync::Arc<Self>, kind: std::io::ErrorKind) -> FaultGuard {
        *self.kind.lock().expect("fault lock") = Some(kind);
        FaultGuard(self.clone())
    }
}

/// See [`InjectedFault::inject`].
#[cfg(test)]
pub(crate) struct FaultGuard(std::sync::Arc<InjectedFault>);

#[cfg(test)]
impl Drop for FaultGuard {
    fn drop(&mut self) {
        *self.0.kind.lock().expect("fault lock") = None;
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
