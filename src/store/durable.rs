//! How far the write-ahead log is durable: one mark, which the flusher moves
//! and two kinds of waiter read. Writers on the runtime wait for their
//! write's ticket asynchronously; a thread applying a set to sled (the
//! applier's, or a scan's that needs it applied) waits for the set's newest
//! ticket, blocking. Beside the mark, whether the log's appends are
//! failing: a failure wakes every waiter, and those that may give up (a
//! read, and a thread applying a set) do so at once; writes wait on.

use super::failing::{Failing, Failure};
use std::sync::{Condvar, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// What a failing log cannot do, as its [`super::failing::Failure`] says.
const LOG_FAILING: &str = "the ledger's log cannot make writes durable";

/// The latest log ticket made durable.
#[derive(Default)]
pub struct DurableMark {
    /// The ticket; async waiters subscribe to it.
    ticket: watch::Sender<u64>,
    /// Threads blocked in [`DurableMark::wait_blocking`]: only then do
    /// [`DurableMark::advance`] and [`DurableMark::log_failed`] notify (a
    /// notify is a syscall even with no one waiting).
    blocked: Mutex<usize>,
    /// Signalled when the ticket moves or the log fails while a thread is
    /// blocked.
    moved: Condvar,
    /// Whether the log's appends fail: writes noted meanwhile wait until one
    /// succeeds (the flusher tries again every 100 ms).
    log: Failing,
}

impl DurableMark {
    /// The latest durable ticket.
    pub fn get(&self) -> u64 {
        *self.ticket.borrow()
    }

    /// The log is durable up to `ticket` (the flusher calls it).
    pub fn advance(&self, ticket: u64) {
        self.ticket.send_replace(ticket);
        // Taken after the store: a thread that read the old ticket under
        // this lock is waiting on the condvar by now, so it is woken. The
        // notify comes after the unlock, so the woken thread does not block
        // at once on this lock.
        self.wake_blocked();
    }

    fn wake_blocked(&self) {
        let blocked = *self.blocked.lock().expect("durable mark lock");
        if blocked > 0 {
            self.moved.notify_all();
        }
    }

    /// An append failed with `error` (the flusher calls it): recorded, and
    /// every waiter woken to see it.
    pub fn log_failed(&self, error: String) {
        self.log.failed(LOG_FAILING, error);
        // Stored before the wake: a woken waiter sees the failure.
        self.ticket.send_modify(|_| {});
        self.wake_blocked();
    }

    /// An append succeeded: the failure it ends, if appends were failing.
    pub fn log_recovered(&self) -> Option<Failure> {
        self.log.recovered()
    }

    /// What is failing, while the log's appends fail.
    pub fn log_failure(&self) -> Option<Failure> {
        self.log.failure()
    }

    /// Appends that failed since the ledger opened.
    pub fn log_failed_attempts(&self) -> u64 {
        self.log.attempts_total()
    }

    /// Waits until the log is durable up to `ticket`.
    pub async fn wait(&self, ticket: u64) {
        if self.get() >= ticket {
            return;
        }
        let mut durable = self.ticket.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = durable.wait_for(|durable| *durable >= ticket).await;
    }

    /// Waits until the log is durable up to `ticket`, unless its appends
    /// are failing or begin to: then it returns that failure at once.
    pub async fn wait_unless_failing(&self, ticket: u64) -> Result<(), Failure> {
        if self.get() >= ticket {
            return Ok(());
        }
        let mut durable = self.ticket.subscribe();
        loop {
            // The sender lives as long as `self`, so this cannot fail.
            let _ = durable
                .wait_for(|durable| *durable >= ticket || self.log.is_failing())
                .await;
            if self.get() >= ticket {
                return Ok(());
            }
            if let Some(failure) = self.log.failure() {
                return Err(failure);
            }
            // Recovered meanwhile: wait on.
        }
    }

    /// Blocks the calling thread until the log is durable up to `ticket`,
    /// for at most `limit`; false if it was not by then, or once the log's
    /// appends fail.
    pub fn wait_blocking(&self, ticket: u64, limit: Duration) -> bool {
        let mut blocked = self.blocked.lock().expect("durable mark lock");
        if self.get() >= ticket {
            return true;
        }
        *blocked += 1;
        let (mut blocked, waited) = self
            .moved
            .wait_timeout_while(blocked, limit, |_| {
                self.get() < ticket && !self.log.is_failing()
            })
            .expect("durable mark lock");
        *blocked -= 1;
        drop(blocked);
        !waited.timed_out() && self.get() >= ticket
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_blocked_thread_wakes_when_the_mark_reaches_its_ticket() {
        let mark = Arc::new(DurableMark::default());
        let waiter = {
            let mark = mark.clone();
            std::thread::spawn(move || mark.wait_blocking(2, Duration::from_secs(10)))
        };
        mark.advance(1);
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            !waiter.is_finished(),
            "ticket 1 must not release a wait for 2"
        );
        let advanced = std::time::Instant::now();
        mark.advance(2);
        assert!(waiter.join().unwrap());
        // A lost wakeup would end the wait only at its 10 s limit.
        assert!(advanced.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_blocking_wait_gives_up_after_its_limit() {
        let mark = DurableMark::default();
        assert!(mark.wait_blocking(0, Duration::ZERO));
        assert!(!mark.wait_blocking(1, Duration::from_millis(10)));
    }

    #[tokio::test]
    async fn a_failing_log_ends_the_waits_that_may_give_up_at_once() {
        let mark = Arc::new(DurableMark::default());
        mark.advance(1);
        let blocked = {
            let mark = mark.clone();
            std::thread::spawn(move || mark.wait_blocking(2, Duration::from_secs(10)))
        };
        let reader = tokio::spawn({
            let mark = mark.clone();
            async move { mark.wait_unless_failing(2).await }
        });
        let writer = tokio::spawn({
            let mark = mark.clone();
            async move { mark.wait(2).await }
        });
        // Both tasks run on this runtime: waiting here lets them start waiting.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!blocked.is_finished() && !reader.is_finished());

        let failed = std::time::Instant::now();
        mark.log_failed("disk full".into());
        assert!(!blocked.join().unwrap(), "the blocked wait gives up");
        let failure = tokio::time::timeout(Duration::from_secs(5), reader)
            .await
            .expect("the reader gives up")
            .unwrap()
            .expect_err("not durable");
        assert_eq!(failure.error, "disk full");
        // Without a wake on failure they would end only at their limits.
        assert!(failed.elapsed() < Duration::from_secs(5));
        // A write waits the failure out, and a durable ticket is no failure.
        assert!(mark.wait_unless_failing(1).await.is_ok());
        tokio::task::yield_now().await;
        assert!(!writer.is_finished());
        mark.log_recovered();
        mark.advance(2);
        tokio::time::timeout(Duration::from_secs(5), writer)
            .await
            .expect("released")
            .unwrap();
    }

    #[tokio::test]
    async fn an_async_wait_ends_once_the_mark_reaches_its_ticket() {
        let mark = Arc::new(DurableMark::default());
        let waiter = tokio::spawn({
            let mark = mark.clone();
            async move { mark.wait(3).await }
        });
        mark.advance(2);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        mark.advance(3);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("released")
            .unwrap();
    }
}
