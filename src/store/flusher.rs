//! Group commit: one thread flushes sled whenever writes are pending, then
//! publishes the events of everything that flush made durable and releases
//! every writer waiting on it.
//!
//! Why a thread: `flush_async` from many tokio tasks stalls under load, and one
//! flush per writer caps durable writes at about 5 k/s (see STYLE.md). One
//! flusher turns N concurrent writers into one `fsync`.

use super::hub::{EventHub, LedgerEvent};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use tokio::sync::watch;

#[derive(Default)]
struct Pending {
    /// Writes applied to sled so far.
    written: u64,
    /// Events of writes not yet flushed, in write order.
    events: Vec<Arc<LedgerEvent>>,
    stop: bool,
}

/// The group-commit flusher of one sled database.
pub struct Flusher {
    pending: Mutex<Pending>,
    wake: Condvar,
    durable: watch::Sender<u64>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Flusher {
    /// Starts the flusher thread for `db`, publishing to `hub`.
    pub fn start(db: sled::Db, hub: Arc<EventHub>) -> Arc<Self> {
        let (durable, _) = watch::channel(0);
        let flusher = Arc::new(Self {
            pending: Mutex::new(Pending::default()),
            wake: Condvar::new(),
            durable,
            thread: Mutex::new(None),
        });
        let worker = flusher.clone();
        let handle = std::thread::Builder::new()
            .name("baton-flusher".into())
            .spawn(move || worker.run(db, hub))
            .expect("spawn flusher thread");
        *flusher.thread.lock().expect("flusher lock") = Some(handle);
        flusher
    }

    fn run(&self, db: sled::Db, hub: Arc<EventHub>) {
        loop {
            let (target, events) = {
                // std Mutex: held only to swap counters, never across I/O.
                let mut pending = self.pending.lock().expect("flusher lock");
                while pending.written == *self.durable.borrow() && !pending.stop {
                    pending = self.wake.wait(pending).expect("flusher lock");
                }
                if pending.stop && pending.written == *self.durable.borrow() {
                    return;
                }
                (pending.written, std::mem::take(&mut pending.events))
            };
            if let Err(err) = db.flush() {
                // Writers stay blocked rather than being told a lie; sled's
                // errors here are I/O failures the operator must see.
                tracing::error!(%err, "ledger flush failed; retrying");
                std::thread::sleep(std::time::Duration::from_millis(100));
                let mut pending = self.pending.lock().expect("flusher lock");
                let mut retry = events;
                retry.append(&mut pending.events);
                pending.events = retry;
                continue;
            }
            for event in events {
                hub.publish(event);
            }
            self.durable.send_replace(target);
        }
    }

    /// Records that a write was applied, with the events it produced; returns
    /// the write's ticket for [`Flusher::wait_durable`]. Call it under the
    /// ledger's write lock so tickets and events keep write order.
    pub fn note_write(&self, events: Vec<Arc<LedgerEvent>>) -> u64 {
        let mut pending = self.pending.lock().expect("flusher lock");
        pending.written += 1;
        pending.events.extend(events);
        self.wake.notify_one();
        pending.written
    }

    /// The ticket of the latest write.
    pub fn latest_ticket(&self) -> u64 {
        self.pending.lock().expect("flusher lock").written
    }

    /// Waits until the write with `ticket` is on disk.
    pub async fn wait_durable(&self, ticket: u64) {
        let mut durable = self.durable.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = durable.wait_for(|flushed| *flushed >= ticket).await;
    }

    /// Flushes what is pending and stops the thread.
    pub fn stop(&self) {
        self.pending.lock().expect("flusher lock").stop = true;
        self.wake.notify_one();
        if let Some(handle) = self.thread.lock().expect("flusher lock").take() {
            let _ = handle.join();
        }
    }
}
