//! Group commit: one thread appends the frames of every pending write to the
//! write-ahead log with one synchronous write, then publishes the events of what it
//! made durable and releases every writer waiting on it.
//!
//! Why a thread: `flush_async` from many tokio tasks stalls under load, and one
//! sync per writer caps durable writes at a few thousand per second (see
//! STYLE.md). One flusher turns N concurrent writers into one sync.

use super::applier::Applier;
use super::durable::DurableMark;
#[cfg(test)]
use super::failing::FaultGuard;
use super::failing::{Failure, InjectedFault};
use super::hub::{EventHub, LedgerEvent};
use super::wal::Segment;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the flusher waits before it tries a failed append again.
const RETRY_AFTER_FAILURE: Duration = Duration::from_millis(100);

/// How long a stop still tries a failing append before it gives up on the
/// writes waiting for it (none of which was reported durable).
const STOP_GIVES_UP_AFTER: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Pending {
    /// Writes noted so far.
    written: u64,
    /// Encoded frames of writes not yet durable, in write order.
    frames: Vec<u8>,
    /// Events of writes not yet durable, in write order.
    events: Vec<Arc<LedgerEvent>>,
    /// The flusher is waiting for writes: only then does a writer wake it
    /// (a condvar notify is a syscall even with no one waiting).
    idle: bool,
    stop: bool,
    /// Tests hold the log's syncs ([`Flusher::hold`]).
    #[cfg(test)]
    held: bool,
}

impl Pending {
    fn held(&self) -> bool {
        #[cfg(test)]
        return self.held;
        #[cfg(not(test))]
        false
    }
}

/// The nice value the flusher thread asks for, unless it runs higher
/// already. Every writer waits on its syncs, and on a busy machine a woken
/// flusher waited for a core about twice as long as it ran. Measured on the
/// 2-core VM (README history, round 18): the p99 at concurrency 1 fell in six of
/// six alternated pairs, throughput at concurrency 16 moved within the
/// noise, and the p999 at concurrency 16 rose. Without the privilege
/// (`CAP_SYS_NICE`, or an `RLIMIT_NICE` that allows it) the flusher keeps
/// the process's priority.
///
/// Woken, the flusher yields its core before it takes the pending writes
/// (`FLUSHER_YIELDS`), so that writers it would preempt mid-request may join
/// the group (README history, round 30: with one yield, groups at
/// concurrency 64 two to three times larger).
pub const FLUSHER_NICE: i32 = -10;

/// How often the woken flusher yields its core before it takes the pending
/// writes: threads runnable on that core run first, and may add their
/// writes to the group; on an idle core each yield returns at once. Measured on a 2-core VM
/// (round 40, quick runs in rotated order): three yields against one
/// raised the c=16 ratio in five of five rounds (mean of nine runs 0.231
/// against 0.208 over five), with larger groups and no longer p99 at c=1;
/// five and eight yields were no better than three.
const FLUSHER_YIELDS: usize = 3;

/// How much the log's group commit gathers, since the ledger opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogFigures {
    /// Writes made durable.
    pub durable_writes: u64,
    /// Synchronous appends that made them so, one per group.
    pub syncs: u64,
    /// Appends that failed and were tried again.
    pub failed_appends: u64,
}

/// The group-commit flusher of one write-ahead log.
pub struct Flusher {
    pending: Mutex<Pending>,
    wake: Condvar,
    durable: Arc<DurableMark>,
    /// Groups appended durably.
    syncs: AtomicU64,
    /// Where tests make appends fail (`Flusher::fail_appends`).
    fault: Arc<InjectedFault>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The flusher thread's id (Linux): the thread whose priority was raised.
    thread_id: OnceLock<i32>,
}

impl Flusher {
    /// Starts the flusher thread appending to `segment`, moving `durable`,
    /// publishing to `hub` and handing full segments to `applier` for
    /// checkpointing.
    pub fn start(
        segment: Segment,
        durable: Arc<DurableMark>,
        hub: Arc<EventHub>,
        applier: Arc<Applier>,
    ) -> Arc<Self> {
        let flusher = Arc::new(Self {
            pending: Mutex::new(Pending::default()),
            wake: Condvar::new(),
            durable,
            syncs: AtomicU64::new(0),
            fault: Arc::default(),
            thread: Mutex::new(None),
            thread_id: OnceLock::new(),
        });
        let worker = flusher.clone();
        let (started_tx, started) = std::sync::mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("baton-flusher".into())
            .spawn(move || {
                let _ = started_tx.send(raise_priority());
                worker.run(segment, hub, applier)
            })
            .expect("spawn flusher thread");
        *flusher.thread.lock().expect("flusher lock") = Some(handle);
        // Returned once the thread has asked for its priority (microseconds),
        // so that the id names a thread whose priority is settled.
        if let Ok(Some(thread_id)) = started.recv() {
            let _ = flusher.thread_id.set(thread_id);
        }
        flusher
    }

    /// The flusher thread's id (Linux).
    #[cfg(test)]
    pub(crate) fn thread_id(&self) -> Option<i32> {
        self.thread_id.get().copied()
    }

    /// Holds the log's syncs until the guard is dropped: writes are noted
    /// (and readable) but none becomes durable. A sync under way finishes.
    #[cfg(test)]
    pub(crate) fn hold(self: &Arc<Self>) -> LogHold {
        self.pending.lock().expect("flusher lock").held = true;
        LogHold(self.clone())
    }

    fn run(&self, mut segment: Segment, hub: Arc<EventHub>, applier: Arc<Applier>) {
        // Reused between rounds so steady state allocates nothing here.
        let mut frames = Vec::new();
        loop {
            let (target, events) = {
                // std Mutex: held only to swap buffers, never across I/O.
                let Some(pending) = self.wait_for_writes() else {
                    return;
                };
                // Threads runnable on this core may go first (see
                // `FLUSHER_YIELDS`); on an idle core this returns at once.
                drop(pending);
                for _ in 0..FLUSHER_YIELDS {
                    std::thread::yield_now();
                }
                let Some(mut pending) = self.wait_for_writes() else {
                    return;
                };
                // No linger beyond the yield: writers that arrive during
                // this sync form the next group, so groups grow with load.
                frames.clear();
                std::mem::swap(&mut frames, &mut pending.frames);
                (pending.written, std::mem::take(&mut pending.events))
            };
            // Writers stay blocked rather than being told a lie; these are
            // I/O failures the operator must see (readiness, metrics, and
            // new sends refused while they last).
            let mut stopping_since = None;
            while let Err(err) = self.append(&mut segment, &frames) {
                self.durable.log_failed(err.to_string());
                if self.stop_requested() {
                    let since = *stopping_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= STOP_GIVES_UP_AFTER {
                        let waiting = self.latest_ticket() - self.durable.get();
                        tracing::error!(
                            %err,
                            waiting,
                            "stopping with writes the log could not make durable; \
                             none was reported durable, and they are dropped"
                        );
                        return;
                    }
                }
                std::thread::sleep(RETRY_AFTER_FAILURE);
            }
            self.durable.log_recovered();
            // Counted before the mark moves (whose lock orders the two), so
            // no reading shows a write durable without the sync that made it so.
            self.syncs.fetch_add(1, Ordering::Relaxed);
            for event in events {
                hub.publish(event);
            }
            self.durable.advance(target);
            if segment.is_full() {
                match segment.rotate() {
                    Ok(old) => applier.retire(old),
                    Err(err) => tracing::error!(%err, "ledger log rotation failed"),
                }
            }
        }
    }

    /// Appends `frames` durably (in tests, unless a fault is injected).
    fn append(&self, segment: &mut Segment, frames: &[u8]) -> std::io::Result<()> {
        self.fault.check()?;
        segment.append_durably(frames)
    }

    fn stop_requested(&self) -> bool {
        self.pending.lock().expect("flusher lock").stop
    }

    /// What is failing, while the log's appends fail.
    pub fn failure(&self) -> Option<Failure> {
        self.durable.log_failure()
    }

    /// Makes every append fail with `kind` until the guard is dropped.
    #[cfg(test)]
    pub(crate) fn fail_appends(&self, kind: std::io::ErrorKind) -> FaultGuard {
        self.fault.inject(kind)
    }

    /// Waits until writes are pending past the durable mark and the log is
    /// not held, and returns the lock on them; once stopped, returns what is
    /// pending even if held, and `None` when nothing is.
    fn wait_for_writes(&self) -> Option<MutexGuard<'_, Pending>> {
        let mut pending = self.pending.lock().expect("flusher lock");
        while (pending.written == self.durable.get() || pending.held()) && !pending.stop {
            pending.idle = true;
            pending = self.wake.wait(pending).expect("flusher lock");
        }
        pending.idle = false;
        if pending.stop && pending.written == self.durable.get() {
            return None;
        }
        Some(pending)
    }

    /// Queues one write's frames with the events it produced; returns the
    /// write's ticket for [`Flusher::wait_durable`]. `queue` gets the ticket
    /// and the events first, before the write can become durable and its
    /// events published (the applier queues the write with them). Call it under the ledger's
    /// write lock so frames, tickets and events keep write order.
    pub fn note_write(
        &self,
        frames: &[u8],
        events: Vec<Arc<LedgerEvent>>,
        queue: impl FnOnce(u64, &[Arc<LedgerEvent>]),
    ) -> u64 {
        let (ticket, wake) = {
            let mut pending = self.pending.lock().expect("flusher lock");
            pending.written += 1;
            queue(pending.written, &events);
            pending.frames.extend_from_slice(frames);
            pending.events.extend(events);
            (pending.written, std::mem::take(&mut pending.idle))
        };
        // Woken after the unlock: woken under it, the flusher would block
        // at once on the lock this thread still holds, and need a second
        // wake. It cannot miss this one: it waits only while nothing is
        // written past the durable mark.
        if wake {
            self.wake.notify_one();
        }
        ticket
    }

    /// Writes made durable and the syncs that did it, for `GET /metrics`.
    pub fn figures(&self) -> LogFigures {
        // The mark first: the syncs read after it include every one that
        // made those writes durable (counted before the mark moved).
        let durable_writes = self.durable.get();
        LogFigures {
            durable_writes,
            syncs: self.syncs.load(Ordering::Relaxed),
            failed_appends: self.durable.log_failed_attempts(),
        }
    }

    /// The ticket of the latest write.
    pub fn latest_ticket(&self) -> u64 {
        self.pending.lock().expect("flusher lock").written
    }

    /// Waits until the write with `ticket` is on disk.
    pub async fn wait_durable(&self, ticket: u64) {
        self.durable.wait(ticket).await;
    }

    /// Waits until the write with `ticket` is on disk, unless the log's
    /// appends fail: then returns that failure at once.
    pub async fn wait_durable_unless_failing(&self, ticket: u64) -> Result<(), Failure> {
        self.durable.wait_unless_failing(ticket).await
    }

    /// Makes what is pending durable and stops the thread; a log that
    /// cannot append is given 5 s more, and what it could not make durable
    /// is dropped (no writer was told it was durable).
    pub fn stop(&self) {
        self.pending.lock().expect("flusher lock").stop = true;
        self.wake.notify_one();
        if let Some(handle) = self.thread.lock().expect("flusher lock").take() {
            let _ = handle.join();
        }
    }
}

/// See [`Flusher::hold`].
#[cfg(test)]
pub(crate) struct LogHold(Arc<Flusher>);

#[cfg(test)]
impl Drop for LogHold {
    fn drop(&mut self) {
        self.0.pending.lock().expect("flusher lock").held = false;
        self.0.wake.notify_one();
    }
}

/// Asks for [`FLUSHER_NICE`] for the calling thread unless it runs at a
/// higher priority already (on Linux a nice value is a thread's own);
/// returns the thread's id.
#[cfg(target_os = "linux")]
fn raise_priority() -> Option<i32> {
    use rustix::process::{getpriority_process, setpriority_process};
    let thread_id = rustix::thread::gettid();
    let wanted = getpriority_process(Some(thread_id))
        .ok()
        .and_then(priority_to_ask);
    if let Some(nice) = wanted
        && let Err(err) = setpriority_process(Some(thread_id), nice)
    {
        tracing::info!(
            %err,
            nice,
            "the ledger's log flusher keeps the process's priority \
             (a higher one needs CAP_SYS_NICE or an RLIMIT_NICE that allows it)"
        );
    }
    Some(thread_id.as_raw_nonzero().get())
}

/// The nice value a flusher running at `current` asks for: [`FLUSHER_NICE`],
/// unless it runs there or higher already (a lower nice value is a higher
/// priority, and raising the value needs no privilege, so asking blindly
/// would lower it).
#[cfg(any(target_os = "linux", test))]
fn priority_to_ask(current: i32) -> Option<i32> {
    (current > FLUSHER_NICE).then_some(FLUSHER_NICE)
}

/// Elsewhere the flusher keeps the process's priority.
#[cfg(not(target_os = "linux"))]
fn raise_priority() -> Option<i32> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flusher_asks_for_its_priority_only_to_go_higher() {
        for lower in [19, 0, FLUSHER_NICE + 1] {
            assert_eq!(priority_to_ask(lower), Some(FLUSHER_NICE), "from {lower}");
        }
        for settled in [FLUSHER_NICE, FLUSHER_NICE - 5, -20] {
            assert_eq!(priority_to_ask(settled), None, "from {settled}");
        }
    }
}
