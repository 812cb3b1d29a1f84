//! Moves durable ledger writes into sled, in the background and coalesced.
//!
//! A write is durable once its frame is in the write-ahead log; from then
//! until this applier has put it into sled, readers find it in the overlay
//! kept here. Several writes to one task between two applications become one
//! record write and one index re-key, which is what lets the ledger take tens
//! of thousands of transitions per second although every new sled key costs
//! ~10 µs. sled is flushed only at checkpoints (the record file synced
//! first): when the log rotates a segment away, at close, and after
//! start-up has applied the log.
//!
//! Order: one application at a time (`apply_lock`), each taking everything
//! pending, and only once the log holds it durably, so sled never holds a
//! write the log could lose. Keys go into sled one by one, not as atomic
//! batches: each `apply_batch` rolls sled's IO buffer twice, waking all of
//! sled's IO threads every time, and holds a lock that every sled read
//! waits on. Instead an application goes in chunks of tasks, and before
//! each chunk stores its intent (each task with the index keys it adds),
//! replacing the chunk before's, whose records are all in; it writes each
//! task's event chunk and index changes before its record; after the last
//! chunk come the counters and the raw keys, and then the intent is
//! emptied. sled recovers a prefix of its writes. A crash part way is
//! repaired at start-up: the intent's keys that do not match their task's
//! record in sled are removed, the log is replayed (record versions tell
//! which tasks sled holds already), and the counters, which a replay
//! cannot repeat safely, are rebuilt from the by-state index. Scans over
//! several keys hold `apply_lock` shared ([`Applier::applied`]), so they
//! never meet half an application.
//!
//! Record buckets: a task that a set creates and finishes (the common
//! blocking send) changes no more, so its record goes into one bucket with
//! the others of its creation millisecond in that chunk, up to 32 at a time,
//! instead of a key of its own: the records' keys were the larger part of
//! sled's work in an application. A bucket's bytes go into the record file
//! ([`super::record_file`]) and sled holds a pointer to them, so sled does
//! not copy them again each time it rewrites a leaf. A bucket is written
//! only for tasks sled does not hold; a task sled holds (in a bucket or
//! not) gets a key of its own at its next write, and reads look there
//! first ([`Applier::stored_record`]).

use super::durable::DurableMark;
#[cfg(test)]
use super::failing::FaultGuard;
use super::failing::{Failing, Failure, InjectedFault};
use super::hub::LedgerEvent;
use super::record_file::{Pointer, RecordFile};
use super::{LedgerError, ReadTask, TaskMap, TaskRecord, append, keys, wal};
use crate::protocol::wire::ProtoEnum as _;
use crate::protocol::{Message, StreamResponse, TaskState};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, RwLockReadGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// A record as its writer encoded it.
pub struct Encoded {
    /// The whole record, as sled stores it.
    pub json: Box<RawValue>,
    /// The record's task alone, for replies.
    pub task_json: Arc<RawValue>,
}

/// A task's writes not yet in sled: its latest record and every event since.
pub struct PendingTask {
    record: Arc<TaskRecord>,
    /// The record and its task as JSON, when the writer encoded them.
    encoded: Option<Encoded>,
    events: Vec<Arc<LedgerEvent>>,
    /// Whether the set holds the task's creation: sled cannot hold the task
    /// yet, unless an application of this set was cut short.
    created: bool,
    /// The log ticket of the write that made `record` (0: durable already,
    /// as a replayed write is).
    ticket: u64,
}

/// A raw key's write not yet in sled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawWrite {
    /// `Some` to set, `None` to remove.
    pub value: Option<Vec<u8>>,
    /// The log ticket of the write (0: durable already, as a replayed write is).
    pub ticket: u64,
}

/// Writes not yet in sled.
#[derive(Default)]
pub struct PendingSet {
    tasks: TaskMap<PendingTask>,
    /// Task writes gathered, counting each write to the same task.
    task_writes: usize,
    /// Whether a write gathered was logged as what it added to a large
    /// record (see [`GATHER_COALESCING`]).
    additions: bool,
    /// Tasks replayed from the log with writes that fit no record before
    /// them ([`PendingSet::from_log`]): the log is kept for an operator.
    unfit: std::collections::HashSet<String>,
    /// Raw key writes, by key.
    raw: HashMap<Vec<u8>, RawWrite>,
    /// The log ticket of the set's latest write: it is applied only once
    /// that is durable, so sled never holds what the log may lose.
    last_ticket: u64,
}

impl PendingSet {
    fn is_empty(&self) -> bool {
        self.tasks.is_empty() && self.raw.is_empty()
    }

    /// Adds a task write; a later write's record replaces the earlier one.
    /// `created`: the write is the task's creation.
    pub fn add_task(
        &mut self,
        record: Arc<TaskRecord>,
        encoded: Option<Encoded>,
        events: &[Arc<LedgerEvent>],
        created: bool,
        ticket: u64,
    ) {
        self.task_writes += 1;
        // Its writer logged its length but did not encode it whole.
        self.additions |= encoded.is_none() && record.logged_len.total > 0;
        match self.tasks.entry(record.task.id.clone()) {
            std::collections::hash_map::Entry::Occupied(mut pending) => {
                let pending = pending.get_mut();
                pending.record = record;
                pending.encoded = encoded;
                pending.events.extend_from_slice(events);
                pending.ticket = ticket;
            }
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(PendingTask {
                    record,
                    encoded,
                    events: events.to_vec(),
                    created,
                    ticket,
                });
            }
        }
    }

    /// Adds a raw key write made with log ticket `ticket`.
    pub fn set_raw(&mut self, key: Vec<u8>, value: Option<Vec<u8>>, ticket: u64) {
        self.raw.insert(key, RawWrite { value, ticket });
    }

    /// Rebuilds the pending writes of log entries read at start-up. A write
    /// logged as what it added is rebuilt on the record before it: the
    /// log's, else sled's, which `stored` reads.
    pub fn from_log(
        entries: Vec<wal::Entry>,
        mut stored: impl FnMut(&str) -> Result<Option<TaskRecord>, LedgerError>,
    ) -> Result<Self, LedgerError> {
        let mut set = Self::default();
        // sled's records of tasks whose writes the log holds additions of.
        let mut in_sled: TaskMap<Option<Arc<TaskRecord>>> = TaskMap::default();
        let shared_events = |task_id: &str, events: Vec<(u64, StreamResponse)>| {
            events
                .into_iter()
                .map(|(seq, event)| Arc::new(LedgerEvent::new(task_id.to_string(), seq, event)))
                .collect::<Vec<_>>()
        };
        for entry in entries {
            match entry {
                wal::Entry::Put { key, value } => set.set_raw(key, Some(value), 0),
                wal::Entry::Remove { key } => set.set_raw(key, None, 0),
                wal::Entry::Task { record, events } => {
                    let events = shared_events(&record.task.id, events);
                    // sled may hold what the log does: nothing counts as new.
                    set.add_task(Arc::new(*record), None, &events, false, 0);
                }
                wal::Entry::TaskAppend {
                    head,
                    history_from,
                    history,
                    artifacts,
                    events,
                } => {
                    let additions = (history_from, history, artifacts);
                    let events = shared_events(&head.task.id, events);
                    set.replay_additions(*head, additions, events, &mut in_sled, &mut stored)?;
                }
            }
        }
        Ok(set)
    }

    /// Rebuilds a write logged as what it added on the record before it,
    /// changed in place: the set's, else sled's (read once per task into
    /// `in_sled`). A write sled holds already is skipped; one that fits no
    /// record leaves its task as it was and is noted in `unfit`.
    fn replay_additions(
        &mut self,
        head: TaskRecord,
        (history_from, history, artifacts): (usize, Vec<Message>, Vec<append::ArtifactChange>),
        events: Vec<Arc<LedgerEvent>>,
        in_sled: &mut TaskMap<Option<Arc<TaskRecord>>>,
        stored: &mut impl FnMut(&str) -> Result<Option<TaskRecord>, LedgerError>,
    ) -> Result<(), LedgerError> {
        let (task_id, version) = (head.task.id.clone(), head.version);
        let apply = |record: &mut Arc<TaskRecord>| {
            let record = Arc::make_mut(record);
            append::apply(record, head, history_from, history, artifacts)
        };
        let rebuilt = match self.tasks.get_mut(&task_id) {
            Some(pending) => apply(&mut pending.record).map(|()| pending.record.clone()),
            None => {
                let cached = match in_sled.entry(task_id.clone()) {
                    std::collections::hash_map::Entry::Occupied(cached) => cached.into_mut(),
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        slot.insert(stored_or_none(&task_id, stored)?.map(Arc::new))
                    }
                };
                match cached {
                    // sled holds this write already (its application came
                    // after the last checkpoint).
                    Some(record) if record.version >= version => return Ok(()),
                    // Taken out once applied: from now on the set holds it.
                    Some(record) => apply(record).map(|()| cached.take().expect("applied")),
                    None => Err("no record of the task comes before it".to_string()),
                }
            }
        };
        match rebuilt {
            Ok(record) => self.add_task(record, None, &events, false, 0),
            // Only lost or damaged data does this; said once per task.
            Err(why) => {
                if self.unfit.insert(task_id.clone()) {
                    tracing::error!(
                        task_id,
                        version,
                        "a logged write of a task does not fit the record before it \
                         ({why}); the task is left as it was, and the log is kept"
                    );
                }
            }
        }
        Ok(())
    }
}

/// A task's record as `stored` reads it from sled; one that does not
/// decode is none (the replay then leaves the task as it is, and keeps the
/// log), as start-up leaves any such record.
fn stored_or_none(
    task_id: &str,
    stored: &mut impl FnMut(&str) -> Result<Option<TaskRecord>, LedgerError>,
) -> Result<Option<TaskRecord>, LedgerError> {
    match stored(task_id) {
        Err(err) if err.is_corrupt() => {
            tracing::error!(task_id, %err, "the stored record of a task with logged writes does not decode");
            Ok(None)
        }
        read => read,
    }
}

/// The most writes a replaced set may hold to be freed by a writer (see
/// `Overlay::spent`): a blocking send's set at c=16 holds ~20–25; freeing
/// thousands of records or events would hold up the writer's other requests.
const SPENT_BY_WRITERS_MAX: usize = 512;

#[derive(Default)]
struct Overlay {
    /// Writes since the last application began.
    pending: PendingSet,
    /// The writes being applied now (or whose application failed).
    applying: Option<Arc<PendingSet>>,
    /// The set applied last, kept until the next one is applied: a task
    /// read just after it reached sled (a blocking send's reply, a client
    /// polling GetTask) is found here, with its task's JSON, instead of
    /// decoded from sled again. Only this applier writes task records, so
    /// these match sled. Only its tasks are read here: its raw writes are
    /// in sled.
    recent: Option<Arc<PendingSet>>,
    /// Sets replaced as `recent`, for writers to free (see
    /// [`Applier::free_spent`]): their records, JSON and events were
    /// allocated on the runtime's threads, and memory freed on another
    /// thread comes back to its owner through mimalloc's cross-thread free
    /// lists, whose collection the owner pays for in cache misses (3.7 % of
    /// Baton's CPU samples at c=16 when the applier freed them, 1.2 % when
    /// writers did, in one profile each).
    /// With the ledger idle, the applier frees them (and the recent set)
    /// after [`IDLE_RELEASE`].
    spent: Vec<Arc<PendingSet>>,
    /// Log segments whose writes must reach sled before they are deleted.
    retired: Vec<PathBuf>,
    stop: bool,
}

/// The background applier of one ledger.
pub struct Applier {
    db: sled::Db,
    tree: sled::Tree,
    wal_dir: PathBuf,
    /// Where record buckets go (see [`super::record_file`]).
    records: RecordFile,
    // std Mutexes: in-memory work only; never held across .await.
    overlay: Mutex<Overlay>,
    wake: Condvar,
    /// Held to write into sled (exclusive) and to scan it (shared): an
    /// application is not atomic, so a scan beside one could meet a task
    /// in two states, or in none.
    apply_lock: RwLock<()>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Whether the last set taken wrote its tasks twice or more on average,
    /// or added to a large record; picks the next gather window. A set of
    /// [`GATHER_SINGLE`] sees the former only where each task is written
    /// about once a millisecond or more (here each of 64 writers writes its
    /// task every ~0.4 ms), so slower writers stay on the short window.
    coalescing: AtomicBool,
    /// Set while an application runs, and left set when it fails part way
    /// (or start-up finds one the process stopped in): sled may then hold
    /// some of its tasks, new ones included, and its counters miss their
    /// changes until the next application rebuilds them.
    partly_applied: AtomicBool,
    /// Whether `Overlay::spent` holds a set (read without the lock).
    has_spent: AtomicBool,
    /// How far the log is durable; the flusher moves it.
    durable: Arc<DurableMark>,
    /// Whether applications into sled fail (they are tried again every
    /// 100 ms, the log keeping their writes meanwhile); a log that does not
    /// sync in time is not one of them.
    applying: Failing,
    /// Whether checkpoints fail (sled's flush; the log is kept meanwhile).
    checkpointing: Failing,
    /// Where tests make applications and checkpoints fail (`Applier::fail`).
    fault: Arc<InjectedFault>,
}

/// What a failing application cannot do, as its [`Failure`] says.
const APPLY_FAILING: &str = "the ledger cannot apply writes to sled";

/// What a failing checkpoint cannot do, as its [`Failure`] says.
const CHECKPOINT_FAILING: &str = "the ledger cannot checkpoint sled, and keeps its log";

/// How long an application waits for the log to sync its writes.
const DURABLE_WAIT: Duration = Duration::from_secs(1);

/// How long the applier waits for writes before it frees the sets it
/// applied (left for the next writer to free, or kept for reads).
const IDLE_RELEASE: Duration = Duration::from_secs(1);

/// Tasks per intent: an intent is one sled value, rewritten per chunk, so
/// a large set (a 50 ms window of many writers) is applied in chunks.
const TASKS_PER_INTENT: usize = 128;

/// How long the applier lets writes gather before it applies them, while
/// writes coalesce (several to one task): longer coalesces more, and readers
/// do not wait for it (they read the overlay). Measured with 64 writers:
/// 43–49 k transitions/s at 20 ms, 52.5–56.7 k/s at 50 ms, as the
/// applier's sled work shares the cores with the writers. Also while a
/// large record is written again and again (an answer streamed in chunks),
/// its writes logged as what they add (see [`super::append`]): each
/// application encodes and stores it whole.
const GATHER_COALESCING: Duration = Duration::from_millis(50);

/// The gather window while each task is written about once, as blocking
/// sends write it: a long window makes a large burst of sled work that
/// requests running beside it wait for. README history, round 32: at c=64, 2 ms
/// served more than 5 ms in five of six alternated pairs and 1 ms more than
/// 2 ms in two of three; at 0 ms the applier's CPU per request rose by a third.
const GATHER_SINGLE: Duration = Duration::from_millis(1);

/// The record file's name, in the ledger's directory.
pub(super) const RECORD_FILE: &str = "record-buckets";

impl Applier {
    /// An applier for `tree`, applying writes once `durable` says the log
    /// holds them, with its record file beside the log's directory; call
    /// [`Applier::start`] to run it.
    pub fn new(
        db: sled::Db,
        tree: sled::Tree,
        wal_dir: PathBuf,
        durable: Arc<DurableMark>,
    ) -> Result<Arc<Self>, LedgerError> {
        let path = wal_dir.with_file_name(RECORD_FILE);
        let synced = read_counter(&tree, keys::records_synced())?;
        let lost = |held: &str| {
            storage_io(std::io::Error::other(format!(
                "the record file {} {held}, but {synced} bytes were synced into it: \
                 it was lost, truncated or replaced; restore the ledger directory from a backup",
                path.display(),
            )))
        };
        // Created only while nothing was synced into it: else an empty one
        // would stand in for a lost one.
        let records = match RecordFile::open(&path, synced == 0) {
            Ok(records) => records,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                return Err(lost("is missing"));
            }
            Err(err) => return Err(storage_io(err)),
        };
        if records.end() < synced {
            return Err(lost(&format!("holds {} bytes", records.end())));
        }
        Ok(Arc::new(Self {
            db,
            tree,
            wal_dir,
            records,
            overlay: Mutex::new(Overlay::default()),
            wake: Condvar::new(),
            apply_lock: RwLock::new(()),
            thread: Mutex::new(None),
            coalescing: AtomicBool::new(false),
            partly_applied: AtomicBool::new(false),
            has_spent: AtomicBool::new(false),
            durable,
            applying: Failing::default(),
            checkpointing: Failing::default(),
            fault: Arc::default(),
        }))
    }

    /// Starts the applier thread.
    pub fn start(self: &Arc<Self>) {
        let worker = self.clone();
        let handle = std::thread::Builder::new()
            .name("baton-applier".into())
            .spawn(move || worker.run())
            .expect("spawn applier thread");
        *self.thread.lock().expect("applier lock") = Some(handle);
    }

    fn run(&self) {
        loop {
            let (retired, stop) = {
                let mut overlay = self.overlay.lock().expect("applier lock");
                while overlay.pending.is_empty()
                    && overlay.retired.is_empty()
                    && overlay.applying.is_none()
                    && !overlay.stop
                {
                    let (woken, wait) = self
                        .wake
                        .wait_timeout(overlay, IDLE_RELEASE)
                        .expect("applier lock");
                    overlay = woken;
                    if wait.timed_out() && (overlay.recent.is_some() || !overlay.spent.is_empty()) {
                        // No writer comes to free what was applied: sled
                        // serves those tasks from now on.
                        let applied = (std::mem::take(&mut overlay.spent), overlay.recent.take());
                        self.has_spent.store(false, Ordering::Relaxed);
                        drop(overlay);
                        drop(applied);
                        overlay = self.overlay.lock().expect("applier lock");
                    }
                }
                (std::mem::take(&mut overlay.retired), overlay.stop)
            };
            if !stop {
                std::thread::sleep(if self.coalescing.load(Ordering::Relaxed) {
                    GATHER_COALESCING
                } else {
                    GATHER_SINGLE
                });
            }
            if let Err(err) = self.apply_pending() {
                if stop {
                    // The log still holds these writes; the next start applies them.
                    tracing::error!(%err, "applying ledger writes to sled failed at close");
                    return;
                }
                // Recorded and logged where it failed (`apply_pending`).
                std::thread::sleep(Duration::from_millis(100));
                self.retire_again(retired);
                continue;
            }
            if stop {
                let segments = wal::segments(&self.wal_dir).unwrap_or_default();
                self.checkpoint(segments.into_iter().map(|(_, path)| path).collect());
                return;
            }
            if !retired.is_empty() && !self.checkpoint(retired) {
                // Retried after a pause, before any segment retired since.
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Flushes sled, then deletes log segments whose writes it now holds,
    /// oldest first; false if some are kept (see [`Applier::retire_again`]).
    fn checkpoint(&self, segments: Vec<PathBuf>) -> bool {
        let kept = match self.flush() {
            Ok(()) => {
                let kept = delete_in_order(segments, remove_durably);
                self.checkpointing.recovered();
                kept
            }
            Err(err) => {
                self.checkpointing
                    .failed(CHECKPOINT_FAILING, err.to_string());
                segments
            }
        };
        if kept.is_empty() {
            return true;
        }
        self.retire_again(kept);
        false
    }

    /// Puts back retired segments that an application or a checkpoint
    /// could not finish with, ahead of any retired since, so they are still
    /// deleted oldest first: a segment left behind a deleted later one
    /// would, after a crash, replay its raw writes (which carry no version)
    /// over newer ones.
    fn retire_again(&self, taken: Vec<PathBuf>) {
        if taken.is_empty() {
            return;
        }
        let mut overlay = self.overlay.lock().expect("applier lock");
        let later = std::mem::replace(&mut overlay.retired, taken);
        overlay.retired.extend(later);
    }

    /// What is failing in sled, while applications or checkpoints fail.
    pub fn failure(&self) -> Option<Failure> {
        self.applying
            .failure()
            .or_else(|| self.checkpointing.failure())
    }

    /// Makes every application and checkpoint fail with `kind` until the
    /// guard is dropped.
    #[cfg(test)]
    pub(crate) fn fail(&self, kind: std::io::ErrorKind) -> FaultGuard {
        self.fault.inject(kind)
    }

    /// Applications and checkpoints that failed since the ledger opened.
    pub fn failed_attempts(&self) -> u64 {
        self.applying.attempts_total() + self.checkpointing.attempts_total()
    }

    /// Makes what sled holds durable: the record file first, then sled
    /// with the length the record file is durable to, so that sled never
    /// durably points past it unless the log still holds the write.
    fn flush(&self) -> Result<(), LedgerError> {
        self.fault.check().map_err(storage_io)?;
        let synced = self.records.sync().map_err(storage_io)?;
        self.tree
            .insert(keys::records_synced(), &synced.to_be_bytes())?;
        self.db.flush()?;
        Ok(())
    }

    /// Queues a task write with the log ticket it will get (call under the
    /// ledger's write lock). `created`: the write creates the task.
    pub fn add_task(
        &self,
        record: Arc<TaskRecord>,
        encoded: Option<Encoded>,
        events: &[Arc<LedgerEvent>],
        ticket: u64,
        created: bool,
    ) {
        let wake = {
            let mut overlay = self.overlay.lock().expect("applier lock");
            let wake = overlay.pending.is_empty();
            overlay
                .pending
                .add_task(record, encoded, events, created, ticket);
            overlay.pending.last_ticket = ticket;
            wake
        };
        self.wake_after_unlock(wake);
    }

    /// Queues a raw key write with the log ticket it will get (call under
    /// the ledger's write lock).
    pub fn set_raw(&self, key: Vec<u8>, value: Option<Vec<u8>>, ticket: u64) {
        let wake = {
            let mut overlay = self.overlay.lock().expect("applier lock");
            let wake = overlay.pending.is_empty();
            overlay.pending.set_raw(key, value, ticket);
            overlay.pending.last_ticket = ticket;
            wake
        };
        self.wake_after_unlock(wake);
    }

    /// Frees one set the applier replaced (see `Overlay::spent`). The ledger
    /// calls it after each write, once the write lock is released: the frees
    /// touch cold memory and must not hold up other writers or the flusher.
    pub fn free_spent(&self) {
        // Most writes find nothing to free: they skip the overlay lock. A
        // set missed by a stale read here is freed by a later write.
        if !self.has_spent.load(Ordering::Relaxed) {
            return;
        }
        let spent = {
            let mut overlay = self.overlay.lock().expect("applier lock");
            let spent = overlay.spent.pop();
            self.has_spent
                .store(!overlay.spent.is_empty(), Ordering::Relaxed);
            spent
        };
        drop(spent);
    }

    /// Wakes the applier thread when a write made the pending set non-empty.
    /// Called after the overlay lock is released: woken under it, the thread
    /// would block at once on that lock and need a second wake. It cannot
    /// miss this one: it waits only while the pending set is empty.
    fn wake_after_unlock(&self, wake: bool) {
        if wake {
            self.wake.notify_one();
        }
    }

    /// Waits until the log is durable up to `ticket`. A set's newest write
    /// is usually still in the flusher's current sync, so an application
    /// typically waits for that one sync (well under a millisecond here);
    /// a scan that finds writes pending waits with it. A log that does not
    /// sync for a second fails the application, which is retried; one whose
    /// appends fail fails it at once.
    fn wait_durable(&self, ticket: u64) -> Result<(), LedgerError> {
        // Read again: a log recovering clears its failure before its mark.
        if self.durable.wait_blocking(ticket, DURABLE_WAIT) || self.durable.get() >= ticket {
            return Ok(());
        }
        if let Some(failure) = self.durable.log_failure() {
            return Err(LedgerError::Unavailable(failure.to_string()));
        }
        let stalled = std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the log did not make the writes durable",
        );
        Err(storage_io(stalled))
    }

    /// Hands over a log segment to delete once its writes are in sled.
    pub fn retire(&self, segment: PathBuf) {
        self.overlay
            .lock()
            .expect("applier lock")
            .retired
            .push(segment);
        self.wake.notify_one();
    }

    /// The retired segments waiting for a checkpoint, oldest first.
    #[cfg(test)]
    pub(crate) fn retired_segments(&self) -> Vec<PathBuf> {
        self.overlay.lock().expect("applier lock").retired.clone()
    }

    /// A task's record if it has writes not yet in sled, or reached sled
    /// with the set applied last; with its task's JSON if its writer
    /// encoded it (not for a record replayed from the log, nor for a write
    /// logged as what it added).
    pub fn task(&self, task_id: &str) -> Option<ReadTask> {
        let overlay = self.overlay.lock().expect("applier lock");
        let in_set = |set: &PendingSet| {
            set.tasks.get(task_id).map(|p| ReadTask {
                record: p.record.clone(),
                task_json: p.encoded.as_ref().map(|e| e.task_json.clone()),
                ticket: p.ticket,
            })
        };
        in_set(&overlay.pending)
            .or_else(|| overlay.applying.as_deref().and_then(in_set))
            .or_else(|| overlay.recent.as_deref().and_then(in_set))
    }

    /// A raw key's pending write; `None` if sled is up to date for it.
    pub fn raw(&self, key: &[u8]) -> Option<RawWrite> {
        let overlay = self.overlay.lock().expect("applier lock");
        let in_set = |set: &PendingSet| set.raw.get(key).cloned();
        in_set(&overlay.pending).or_else(|| overlay.applying.as_deref().and_then(in_set))
    }

    /// The pending raw writes of keys under `prefix`, oldest set first.
    pub fn raw_under(&self, prefix: &[u8]) -> Vec<(Vec<u8>, RawWrite)> {
        let overlay = self.overlay.lock().expect("applier lock");
        let under = |set: &PendingSet| {
            set.raw
                .iter()
                .filter(|(key, _)| key.starts_with(prefix))
                .map(|(key, write)| (key.clone(), write.clone()))
                .collect::<Vec<_>>()
        };
        let mut found = overlay.applying.as_deref().map(under).unwrap_or_default();
        found.extend(under(&overlay.pending));
        found
    }

    /// Applies every pending write to sled now, so that scans see them.
    pub fn apply_pending(&self) -> Result<(), LedgerError> {
        let _applying = self.apply_lock.write().expect("applier lock");
        // A set that failed is retried first; then what is pending goes too.
        while let Some((set, retried)) = self.take_set() {
            // The log's to report, not sled's.
            self.wait_durable(set.last_ticket)?;
            // Recorded under the lock, so an application on another thread
            // (a scan's) cannot clear it before it is recorded, or after.
            if let Err(err) = self.apply(&set) {
                self.applying.failed(APPLY_FAILING, err.to_string());
                let failure = self.applying.failure().map(|f| f.to_string());
                return Err(LedgerError::Unavailable(failure.unwrap_or_default()));
            }
            // All in one step: the set before may hold older records of this
            // set's tasks, and sled now has the newer ones.
            let mut overlay = self.overlay.lock().expect("applier lock");
            overlay.applying = None;
            let previous = match overlay.recent.replace(set) {
                Some(small) if small.task_writes + small.raw.len() <= SPENT_BY_WRITERS_MAX => {
                    overlay.spent.push(small);
                    self.has_spent.store(true, Ordering::Relaxed);
                    None
                }
                large => large,
            };
            drop(overlay);
            // A large set would hold up the writer that frees it; it is freed
            // here, outside the lock.
            drop(previous);
            if !retried {
                break;
            }
        }
        // Nothing failed is left to apply: whoever applied it, sled works.
        self.applying.recovered();
        Ok(())
    }

    /// The set to apply next: one that failed (then `true`), else what is
    /// pending.
    fn take_set(&self) -> Option<(Arc<PendingSet>, bool)> {
        let mut overlay = self.overlay.lock().expect("applier lock");
        if let Some(failed) = &overlay.applying {
            return Some((failed.clone(), true));
        }
        if overlay.pending.is_empty() {
            return None;
        }
        let set = Arc::new(std::mem::take(&mut overlay.pending));
        let coalescing = set.task_writes >= 2 * set.tasks.len() || set.additions;
        self.coalescing.store(coalescing, Ordering::Relaxed);
        overlay.applying = Some(set.clone());
        Some((set, false))
    }

    /// Whether writes wait to go into sled.
    fn has_pending(&self) -> bool {
        let overlay = self.overlay.lock().expect("applier lock");
        overlay.applying.is_some() || !overlay.pending.is_empty()
    }

    /// Applies every pending write to sled, and keeps any other application
    /// out while the guard lives: sled then holds every write logged before
    /// the call, whole, for a scan over several keys. Scans share the lock,
    /// so with nothing pending they run side by side.
    pub fn applied(&self) -> Result<RwLockReadGuard<'_, ()>, LedgerError> {
        if let Ok(guard) = self.apply_lock.try_read()
            && !self.has_pending()
        {
            return Ok(guard);
        }
        // Waiting for an application (a log sync, then a set's sled writes)
        // would hold up every task queued on this runtime worker.
        off_the_runtime(|| {
            self.apply_pending()?;
            Ok(self.apply_lock.read().expect("applier lock"))
        })
    }

    /// Applies writes read back from the log at start-up, checkpoints, and
    /// deletes the log's segments as a checkpoint does.
    pub fn recover(&self, set: PendingSet) -> Result<(), LedgerError> {
        // An application the process stopped in: sled may hold index keys
        // of versions the log replay does not end at, and its counters miss
        // changes. Without one, sled holds whole sets only.
        let interrupted = self
            .tree
            .get(keys::applying())?
            .filter(|intent| !intent.is_empty());
        // Bucket pointers whose bytes the crash lost: their tasks' index
        // keys and counts are in sled, their records are not, so they are
        // applied again from the log, and counted again.
        let lost_buckets = !set.is_empty() && self.remove_lost_buckets()?;
        if lost_buckets {
            self.partly_applied.store(true, Ordering::Relaxed);
        }
        if let Some(intent) = &interrupted {
            self.remove_stale_index_keys(intent)?;
            self.partly_applied.store(true, Ordering::Relaxed);
        }
        if interrupted.is_some() || lost_buckets || !set.is_empty() {
            self.apply(&set)?;
        }
        self.flush()?;
        let replayed = wal::segments(&self.wal_dir).map_err(storage_io)?;
        if !set.unfit.is_empty() && !replayed.is_empty() {
            // They hold the only copy of the writes that fit no record.
            let kept = wal::keep_damaged(&self.wal_dir, &replayed).map_err(storage_io)?;
            let tasks = set.unfit.len();
            tracing::error!(kept = %kept.display(), tasks, "the replayed log is kept, as it holds writes that were not replayed");
            return Ok(());
        }
        let replayed = replayed.into_iter().map(|(_, path)| path).collect();
        // One left would be replayed again at the next start, over newer writes.
        if let Some(kept) = delete_in_order(replayed, remove_durably).first() {
            return Err(storage_io(std::io::Error::other(format!(
                "could not delete the replayed log segment {}",
                kept.display()
            ))));
        }
        Ok(())
    }

    /// Removes the record buckets whose bytes are not in the record file as
    /// written; true if there were any. Only buckets past the length the
    /// file was last synced to can be lost, and only while the log holds
    /// their writes: a clean stop leaves no log, and this is not called.
    fn remove_lost_buckets(&self) -> Result<bool, LedgerError> {
        let synced = read_counter(&self.tree, keys::records_synced())?;
        let mut lost = Vec::new();
        for entry in self.tree.scan_prefix(keys::record_bucket_all_prefix()) {
            let (key, value) = entry?;
            if let Some(pointer) = Pointer::decode(&value)
                && pointer.end() > synced
                && self.records.read(&pointer).map_err(storage_io)?.is_none()
            {
                lost.push(key);
            }
        }
        if !lost.is_empty() {
            // Should this recovery stop part way, the next start-up must
            // still recount: sled keeps a prefix of its writes, so this goes
            // in before any removal.
            // An intent whose one task has no id and adds no keys: it
            // repairs nothing and makes start-up recount.
            let no_keys = Vec::new();
            let recount = encode_intent(std::iter::once(("", &no_keys)));
            self.tree.insert(keys::applying(), recount)?;
        }
        for key in &lost {
            tracing::warn!(
                bucket = %key.escape_ascii(),
                "a record bucket was lost in a crash; applying its tasks again from the log"
            );
            self.tree.remove(key)?;
        }
        Ok(!lost.is_empty())
    }

    /// Writes one set into sled: first the index keys it adds (its intent),
    /// then each task's event chunk and index changes before its record,
    /// then the counters and the raw keys, and last it removes the intent.
    /// A task whose sled record is as new as the pending one (a log replayed
    /// after a crash, a retried application) is skipped.
    fn apply(&self, set: &PendingSet) -> Result<(), LedgerError> {
        self.fault.check().map_err(storage_io)?;
        // Set until the whole set is in: a failure part way leaves sled
        // holding some of it, and the retry must not trust `created`.
        let partly_applied = self.partly_applied.swap(true, Ordering::Relaxed);
        // In id order: a UUIDv7 id starts with its creation millisecond, so
        // a chunk takes whole milliseconds and fills their buckets (in the
        // map's order, a 1 M store's record buckets held one task each).
        let mut tasks: Vec<(&String, &PendingTask)> = set.tasks.iter().collect();
        tasks.sort_unstable_by_key(|(id, _)| *id);
        let mut counts = CounterDeltas::default();
        for chunk in tasks.chunks(TASKS_PER_INTENT) {
            let indexed: Vec<(&str, &PendingTask, Vec<Vec<u8>>)> = chunk
                .iter()
                .map(|&(task_id, pending)| {
                    (
                        task_id.as_str(),
                        pending,
                        record_index_keys(&pending.record),
                    )
                })
                .collect();
            // The index keys this chunk adds, for repairing a crash part
            // way; it replaces the last chunk's, whose records are all in.
            let intent = encode_intent(indexed.iter().map(|(id, _, index)| (*id, index)));
            self.tree.insert(keys::applying(), intent)?;
            // Each task's state in sled first, then the chunk's buckets, then
            // each task: its bucket entries, like its other index keys, are
            // in before its record.
            let mut planned = Vec::with_capacity(indexed.len());
            let mut buckets = BucketAdditions::default();
            for (task_id, pending, index) in indexed {
                if let Some(plan) = self.plan_task(task_id, pending, index, !partly_applied)? {
                    if plan.reindex {
                        buckets.note(&plan.index);
                    }
                    planned.push(plan);
                }
            }
            buckets.write(&self.tree)?;
            // Record buckets after the chunk's index keys, like records.
            let mut records = RecordBuckets::default();
            for plan in planned {
                let home = records.take(&plan);
                self.apply_task(plan, &mut counts, home)?;
            }
            records.write(&self.tree, &self.records)?;
        }
        if partly_applied {
            recount(&self.tree)?;
        } else {
            for (key, delta) in counts.into_changes() {
                let next = (read_counter(&self.tree, &key)? as i64 + delta).max(0) as u64;
                self.tree.insert(key, &next.to_be_bytes())?;
            }
        }
        for (key, write) in &set.raw {
            match &write.value {
                Some(value) => self.tree.insert(key.as_slice(), value.as_slice())?,
                None => self.tree.remove(key.as_slice())?,
            };
        }
        // Emptied rather than removed: rewriting a key costs sled less than
        // adding one, and every application writes it.
        self.tree.insert(keys::applying(), &[])?;
        self.partly_applied.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// What writing one task into sled takes: the task's head as sled holds
    /// it, unless `trust_created` and the set created it (sled cannot hold
    /// it then). `None` when sled is as new already (a log replayed after a
    /// crash, a retried application). `index`: the record's index keys.
    fn plan_task<'a>(
        &self,
        task_id: &'a str,
        pending: &'a PendingTask,
        index: Vec<Vec<u8>>,
        trust_created: bool,
    ) -> Result<Option<TaskPlan<'a>>, LedgerError> {
        let before: Option<AppliedHead> = if pending.created && trust_created {
            None
        } else {
            match self.stored_record(task_id, None)? {
                Some(bytes) => Some(super::decode_stored(&bytes)?),
                None => None,
            }
        };
        if before
            .as_ref()
            .is_some_and(|b| b.version >= pending.record.version)
        {
            return Ok(None);
        }
        let reindex = before.as_ref().is_none_or(|before| {
            let (old, new) = (&before.task.status, &pending.record.task.status);
            old.state != new.state || old.timestamp != new.timestamp
        });
        Ok(Some(TaskPlan {
            task_id,
            pending,
            index,
            before,
            reindex,
        }))
    }

    /// Writes one planned task into sled, its record last (unless its
    /// `home` is a bucket, written with the others), and notes its counter
    /// changes. Its bucket entries are in already.
    fn apply_task(
        &self,
        plan: TaskPlan<'_>,
        counts: &mut CounterDeltas,
        home: RecordHome,
    ) -> Result<(), LedgerError> {
        let tree = &self.tree;
        let TaskPlan {
            task_id,
            pending,
            index,
            before,
            reindex,
        } = plan;
        let record = &pending.record;
        // One key per task per application: a chunk of consecutive events,
        // from the JSON the writer encoded. A terminal task's events are
        // not kept: nobody can subscribe to it any more, and a stream that
        // fell behind gets its final snapshot instead (see
        // `Ledger::durable_events_after`).
        if !record.task.status.state.is_terminal() {
            let applied_seq = before.as_ref().map_or(0, |b| b.last_seq);
            let fresh: Vec<&LedgerEvent> = pending
                .events
                .iter()
                .filter(|e| e.seq > applied_seq)
                .map(|e| &**e)
                .collect();
            if let Some(first) = fresh.first() {
                let encoded = fresh
                    .iter()
                    .map(|e| e.json())
                    .collect::<Result<Vec<_>, _>>()?;
                tree.insert(
                    keys::event(task_id, first.seq),
                    serde_json::to_vec(&encoded)?,
                )?;
            }
        }
        if reindex {
            if let Some(before) = &before {
                index_remove(tree, counts, before, &index)?;
            }
            index_insert(tree, counts, record, index, before.is_none())?;
            if before.is_none()
                && let Some(parent) = &record.parent_task_id
            {
                tree.insert(keys::child(parent, task_id), &[])?;
            }
        }
        if home == RecordHome::Bucket {
            return Ok(());
        }
        match &pending.encoded {
            Some(encoded) => tree.insert(keys::task(task_id), encoded.json.get().as_bytes())?,
            None => tree.insert(keys::task(task_id), serde_json::to_vec(&**record)?)?,
        };
        Ok(())
    }

    /// Applies what is pending, checkpoints, deletes the log and stops.
    pub fn stop(&self) {
        self.overlay.lock().expect("applier lock").stop = true;
        self.wake.notify_one();
        if let Some(handle) = self.thread.lock().expect("applier lock").take() {
            let _ = handle.join();
        }
    }
}

/// Deletes `segments` in order with `remove` until one fails; returns that
/// one and those after it. A segment already gone counts as deleted.
fn delete_in_order(
    segments: Vec<PathBuf>,
    mut remove: impl FnMut(&std::path::Path) -> std::io::Result<()>,
) -> Vec<PathBuf> {
    let failed = segments.iter().position(|path| match remove(path) {
        Ok(()) => false,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => false,
        Err(err) => {
            tracing::error!(%err, path = %path.display(), "could not delete a checkpointed log segment; keeping it and those after it");
            true
        }
    });
    match failed {
        Some(at) => segments[at..].to_vec(),
        None => Vec::new(),
    }
}

/// Deletes a log segment whose writes sled holds, durably before the next
/// deletion: a crash must not bring back an older segment but not a newer
/// one.
fn remove_durably(path: &std::path::Path) -> std::io::Result<()> {
    std::fs::remove_file(path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    #[cfg(test)]
    tests::DELETED_DURABLY.with_borrow_mut(|deleted| deleted.push(path.to_path_buf()));
    Ok(())
}

/// Runs `work`, which may block for milliseconds: on a worker of a
/// multi-threaded tokio runtime, the worker's other tasks move to another
/// thread meanwhile (elsewhere it just runs).
fn off_the_runtime<R>(work: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

/// A file-system failure of the log, as a ledger storage error.
pub fn storage_io(err: std::io::Error) -> LedgerError {
    LedgerError::Storage(sled::Error::Io(err))
}

/// Most records one record bucket holds: each bucket is one sled key (its
/// pointer), and a read of one of its tasks reads and decompresses it
/// whole. README history, round 33: at 32 rather than 4 the applier took 0.6–1.6 µs
/// less per request at c=16, in eight alternated pairs of eight.
const BUCKET_RECORDS_MAX: usize = 32;

/// Most record bytes one record bucket holds, and the largest record that
/// goes into one.
const BUCKET_BYTES_MAX: usize = 48 * 1024;

/// Where an applied task's record goes in sled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RecordHome {
    /// A key of its own (`keys::task`).
    OwnKey,
    /// A bucket shared with tasks of its creation millisecond.
    Bucket,
}

/// The records of one chunk that go into record buckets instead of keys of
/// their own, by bucket prefix (creation millisecond).
#[derive(Default)]
struct RecordBuckets<'a> {
    by_prefix: BTreeMap<Vec<u8>, Vec<(&'a str, &'a [u8])>>,
}

impl<'a> RecordBuckets<'a> {
    /// Takes `plan`'s record if it belongs in a bucket: a task this write
    /// creates in sled, finished (its record changes no more), small, with
    /// a UUIDv7 id. Returns where the record goes.
    fn take(&mut self, plan: &TaskPlan<'a>) -> RecordHome {
        let pending = plan.pending;
        if plan.before.is_some() || !pending.record.task.status.state.is_terminal() {
            return RecordHome::OwnKey;
        }
        let Some(encoded) = &pending.encoded else {
            return RecordHome::OwnKey;
        };
        let json = encoded.json.get().as_bytes();
        if json.len() > BUCKET_BYTES_MAX {
            return RecordHome::OwnKey;
        }
        let Some(prefix) = keys::record_bucket_prefix(plan.task_id) else {
            return RecordHome::OwnKey;
        };
        self.by_prefix
            .entry(prefix)
            .or_default()
            .push((plan.task_id, json));
        RecordHome::Bucket
    }

    /// Writes the buckets into the record file in one append, then their
    /// pointers into sled, each keyed by its prefix and its first id.
    fn write(self, tree: &sled::Tree, file: &RecordFile) -> Result<(), LedgerError> {
        let (mut keys, mut joined, mut lens) = (Vec::new(), Vec::new(), Vec::new());
        for (prefix, mut records) in self.by_prefix {
            records.sort_unstable_by_key(|(id, _)| *id);
            let mut rest = records.as_slice();
            while let Some(((first, _), _)) = rest.split_first() {
                let (mut value, mut bytes, mut count) = (Vec::new(), 0, 0);
                for (id, json) in rest.iter().take(BUCKET_RECORDS_MAX) {
                    // The first always fits: `take` keeps larger records out.
                    if count > 0 && bytes + json.len() > BUCKET_BYTES_MAX {
                        break;
                    }
                    keys::push_bucket_record(&mut value, id, json);
                    bytes += json.len();
                    count += 1;
                }
                let sealed = keys::seal_record_bucket(value);
                joined.extend_from_slice(&sealed);
                lens.push(sealed.len());
                keys.push([prefix.as_slice(), first.as_bytes()].concat());
                rest = &rest[count..];
            }
        }
        if keys.is_empty() {
            return Ok(());
        }
        let pointers = file.append(&joined, &lens).map_err(storage_io)?;
        for (key, pointer) in keys.into_iter().zip(pointers) {
            tree.insert(key, &pointer.encode())?;
        }
        Ok(())
    }
}

impl Applier {
    /// A task's record as sled holds it, decoded.
    pub fn stored_task(&self, task_id: &str) -> Result<Option<TaskRecord>, LedgerError> {
        self.stored_record(task_id, None)?
            .map(|bytes| Ok(super::decode_stored(&bytes[..])?))
            .transpose()
    }

    /// A task's record as sled holds it: its own key, which a later write
    /// sets, else its entry in a record bucket of its creation millisecond,
    /// found through `memo` when a scan reads several tasks.
    pub fn stored_record(
        &self,
        task_id: &str,
        memo: Option<&mut BucketMemo>,
    ) -> Result<Option<sled::IVec>, LedgerError> {
        let (tree, file) = (&self.tree, &self.records);
        if let Some(record) = tree.get(keys::task(task_id))? {
            return Ok(Some(record));
        }
        let Some(prefix) = keys::record_bucket_prefix(task_id) else {
            return Ok(None);
        };
        if let Some(memo) = memo {
            return memo.buckets(tree, file, prefix)?.find(task_id);
        }
        // A bucket is keyed by its first id: the one holding `task_id` is the
        // nearest at or before it, unless another set's buckets fall between.
        let mut last = prefix.clone();
        last.extend_from_slice(task_id.as_bytes());
        // A bucket that does not check hides no other bucket's tasks (see
        // `MillisecondBuckets::find`); those in range might hold `task_id`.
        let mut corrupt = None;
        for entry in tree.range(prefix..=last).rev() {
            let (key, stored) = entry?;
            match open_bucket(file, stored)? {
                Some(bucket) => {
                    if let Some(record) = record_of(&bucket, task_id) {
                        return Ok(Some(record));
                    }
                }
                None => {
                    corrupt.get_or_insert(key);
                }
            }
        }
        corrupt.map_or(Ok(None), |key| Err(corrupt_bucket(&key)))
    }

    /// Removes the keys an interrupted application added that do not belong
    /// to their task's record as sled holds it: they were written for a
    /// version whose record never made it in.
    fn remove_stale_index_keys(&self, intent: &[u8]) -> Result<(), LedgerError> {
        for (task_id, added) in decode_intent(intent) {
            let current = match self.stored_record(&task_id, None)? {
                Some(bytes) => super::decode_stored::<AppliedHead>(&bytes)?.index_keys(),
                None => Vec::new(),
            };
            for key in added.into_iter().filter(|key| !current.contains(key)) {
                remove_index_key(&self.tree, &key)?;
            }
        }
        Ok(())
    }
}

/// The record of `task_id` in `bucket` (opened, see [`open_bucket`]),
/// sharing the bucket's bytes.
fn record_of(bucket: &sled::IVec, task_id: &str) -> Option<sled::IVec> {
    let record = keys::record_in_bucket(bucket, task_id)?;
    let offset = record.as_ptr() as usize - bucket.as_ptr() as usize;
    Some(bucket.subslice(offset, record.len()))
}

/// A record bucket as sled stores it, opened to its ids and records (see
/// [`keys::open_record_bucket`]): read from the record file when sled holds
/// a pointer to it (or stored in sled itself, by a ledger of format 2 or
/// earlier, where a plain one shares the stored bytes). `None` when its
/// bytes do not check; see [`corrupt_bucket`].
fn open_bucket(file: &RecordFile, stored: sled::IVec) -> Result<Option<sled::IVec>, LedgerError> {
    let stored = match Pointer::decode(&stored) {
        Some(pointer) => match file.read(&pointer).map_err(storage_io)? {
            Some(bytes) => sled::IVec::from(bytes),
            None => return Ok(None),
        },
        None => stored,
    };
    Ok(match keys::open_record_bucket(&stored) {
        Some(Cow::Borrowed(_)) => Some(stored),
        Some(Cow::Owned(plain)) => Some(plain.into()),
        None => None,
    })
}

/// The failure to read the bucket stored under `key`, whose bytes do not
/// check: a storage failure, never a missing task.
fn corrupt_bucket(key: &[u8]) -> LedgerError {
    LedgerError::CorruptBucket(key.escape_ascii().to_string())
}

/// The record buckets of the creation milliseconds a scan of several tasks
/// met, each read once: a page of tasks comes from few milliseconds (in
/// status order, tasks of two or three may alternate), and one forward scan
/// of a millisecond's buckets costs sled less than a backward one per task.
/// Valid only while no application runs ([`Applier::applied`]).
#[derive(Default)]
pub struct BucketMemo {
    /// By millisecond prefix, at most [`BUCKET_MEMO_MILLIS`]; the oldest
    /// read is replaced first.
    millis: Vec<(Vec<u8>, MillisecondBuckets)>,
    next_replaced: usize,
}

/// The record buckets of one creation millisecond, as a [`BucketMemo`]
/// holds them.
struct MillisecondBuckets {
    /// Opened (see [`open_bucket`]).
    readable: Vec<sled::IVec>,
    /// The keys of the buckets that did not check.
    corrupt: Vec<sled::IVec>,
    /// The length of the millisecond's key prefix: a bucket's key is the
    /// prefix and then its first id.
    prefix_len: usize,
}

impl MillisecondBuckets {
    /// The record of `task_id`. A task is in one bucket at most (only tasks
    /// sled lacks are bucketed), and a bucket holds no id before its first.
    /// So a bucket that does not check fails a lookup only when no other
    /// bucket holds the task and the damaged one might (its first id is at
    /// or before the task's): that task cannot be said to be missing.
    fn find(&self, task_id: &str) -> Result<Option<sled::IVec>, LedgerError> {
        if let Some(record) = self
            .readable
            .iter()
            .find_map(|bucket| record_of(bucket, task_id))
        {
            return Ok(Some(record));
        }
        let might_hold = |key: &&sled::IVec| &key[self.prefix_len..] <= task_id.as_bytes();
        match self.corrupt.iter().find(might_hold) {
            Some(key) => Err(corrupt_bucket(key)),
            None => Ok(None),
        }
    }
}

/// Most milliseconds a [`BucketMemo`] holds.
const BUCKET_MEMO_MILLIS: usize = 16;

impl BucketMemo {
    /// The buckets under `prefix`, read from `tree` unless held already.
    fn buckets(
        &mut self,
        tree: &sled::Tree,
        file: &RecordFile,
        prefix: Vec<u8>,
    ) -> Result<&MillisecondBuckets, LedgerError> {
        let at = match self.millis.iter().position(|(held, _)| *held == prefix) {
            Some(at) => at,
            None => {
                let mut buckets = MillisecondBuckets {
                    readable: Vec::new(),
                    corrupt: Vec::new(),
                    prefix_len: prefix.len(),
                };
                for entry in tree.scan_prefix(&prefix) {
                    let (key, stored) = entry?;
                    match open_bucket(file, stored)? {
                        Some(bucket) => buckets.readable.push(bucket),
                        None => buckets.corrupt.push(key),
                    }
                }
                if self.millis.len() < BUCKET_MEMO_MILLIS {
                    self.millis.push((prefix, buckets));
                    self.millis.len() - 1
                } else {
                    let at = self.next_replaced;
                    self.next_replaced = (at + 1) % BUCKET_MEMO_MILLIS;
                    self.millis[at] = (prefix, buckets);
                    at
                }
            }
        };
        Ok(&self.millis[at].1)
    }
}

/// Reads a u64 counter; absent is zero.
pub fn read_counter(tree: &sled::Tree, key: &[u8]) -> Result<u64, LedgerError> {
    Ok(tree
        .get(key)?
        .and_then(|v| v.as_ref().try_into().ok().map(u64::from_be_bytes))
        .unwrap_or(0))
}

/// Rebuilds every owner's counters from the by-state index, which a
/// replayed application leaves exact (its keys are set, not counted).
fn recount(tree: &sled::Tree) -> Result<(), LedgerError> {
    let mut counted: HashMap<Vec<u8>, u64> = HashMap::new();
    // The bucket read last, which sorts just before the keys of its
    // millisecond: a task held both ways (a key spilled from a full bucket,
    // or kept from before buckets, then re-stamped into it) counts once.
    let mut bucket: Option<(sled::IVec, sled::IVec)> = None;
    for entry in tree.scan_prefix(keys::by_state_all_prefix()) {
        let (key, value) = entry?;
        let Some((owner, state, suffix_at)) = keys::by_state_parts(&key) else {
            continue;
        };
        let tasks = if keys::is_bucket_suffix(&key[suffix_at..]) {
            let ids = keys::bucket_ids(&value).len() as u64;
            bucket = Some((key.clone(), value));
            ids
        } else {
            let in_bucket = bucket.as_ref().is_some_and(|(bucket, ids)| {
                key.strip_prefix(bucket.as_ref())
                    .is_some_and(|id| keys::bucket_ids(ids).contains(&id))
            });
            u64::from(!in_bucket)
        };
        *counted
            .entry(keys::state_counter(owner, state))
            .or_default() += tasks;
        *counted.entry(keys::counter(owner, "all")).or_default() += tasks;
    }
    for key in tree.scan_prefix(keys::counter_all_prefix()).keys() {
        let key = key?;
        if keys::is_task_counter(&key) && !counted.contains_key(key.as_ref()) {
            tree.remove(key)?;
        }
    }
    for (key, count) in counted {
        tree.insert(key, &count.to_be_bytes())?;
    }
    Ok(())
}

/// Pending counter changes of one application, summed per owner: each
/// counter's key is built once per application, not once per task.
#[derive(Default)]
struct CounterDeltas {
    owners: HashMap<String, OwnerDeltas>,
}

/// One owner's counter changes: per state number, and of all its tasks.
#[derive(Default)]
struct OwnerDeltas {
    states: HashMap<u8, i64>,
    all: i64,
}

impl CounterDeltas {
    fn owner(&mut self, owner: &str) -> &mut OwnerDeltas {
        // Looked up by `&str` first: an owner's name is copied once.
        if !self.owners.contains_key(owner) {
            self.owners
                .insert(owner.to_string(), OwnerDeltas::default());
        }
        self.owners.get_mut(owner).expect("inserted above")
    }

    /// The counters that change, with their changes.
    fn into_changes(self) -> impl Iterator<Item = (Vec<u8>, i64)> {
        self.owners.into_iter().flat_map(|(owner, deltas)| {
            let all = (deltas.all != 0).then(|| (keys::counter(&owner, "all"), deltas.all));
            let states: Vec<_> = deltas
                .states
                .into_iter()
                .filter(|&(_, delta)| delta != 0)
                .map(|(state, delta)| (keys::state_counter(&owner, state), delta))
                .collect();
            states.into_iter().chain(all)
        })
    }
}

/// Whether an agent is (or was, before a stop) working on a task in `state`.
fn is_active(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::Submitted | TaskState::Working | TaskState::Unspecified
    )
}

/// The index keys of a task in `state`: by state, by context (unless its
/// context was minted from its id), and the active and waiting sets.
fn index_keys(
    owner: &str,
    task_id: &str,
    context_id: &str,
    state: TaskState,
    timestamp: Option<chrono::DateTime<chrono::Utc>>,
) -> Vec<Vec<u8>> {
    let order = keys::order(timestamp, task_id);
    let mut found = vec![[keys::by_state_prefix(owner, state.number()), order.clone()].concat()];
    if !keys::context_is_minted(task_id, context_id) {
        found.push([keys::by_context_prefix(owner, context_id), order].concat());
    }
    if is_active(state) {
        found.push(keys::active(task_id));
    }
    if state.is_interrupted() {
        found.push(keys::waiting(task_id));
    }
    found
}

/// The index keys of a record.
fn record_index_keys(record: &TaskRecord) -> Vec<Vec<u8>> {
    let task = &record.task;
    index_keys(
        &record.owner,
        &task.id,
        &task.context_id,
        task.status.state,
        task.status.timestamp,
    )
}

/// Index entries of a task's current state (`index`, its index keys), but
/// those in buckets, which [`BucketAdditions`] writes; and the counter
/// changes.
fn index_insert(
    tree: &sled::Tree,
    counts: &mut CounterDeltas,
    record: &TaskRecord,
    index: Vec<Vec<u8>>,
    new_task: bool,
) -> Result<(), LedgerError> {
    for key in index {
        if bucket_entry(&key).is_none() {
            tree.insert(key, &[])?;
        }
    }
    let deltas = counts.owner(&record.owner);
    *deltas
        .states
        .entry(record.task.status.state.number())
        .or_default() += 1;
    if new_task {
        deltas.all += 1;
    }
    Ok(())
}

/// One task of a chunk, read and ready to write (see `Applier::plan_task`).
struct TaskPlan<'a> {
    /// The task's id.
    task_id: &'a str,
    /// Its writes.
    pending: &'a PendingTask,
    /// The record's index keys.
    index: Vec<Vec<u8>>,
    /// The task as sled holds it, if it does.
    before: Option<AppliedHead>,
    /// Whether its index entries change: it is new, or its status is.
    reindex: bool,
}

/// The bucket entries a chunk adds, by bucket key (see [`keys::bucket_ids`]).
#[derive(Default)]
struct BucketAdditions {
    ids: BTreeMap<Vec<u8>, Vec<Vec<u8>>>,
}

impl BucketAdditions {
    /// Notes the entries of `index` (a task's index keys) that go in buckets.
    fn note(&mut self, index: &[Vec<u8>]) {
        for (bucket, id) in index.iter().filter_map(|key| bucket_entry(key)) {
            self.ids
                .entry(bucket.to_vec())
                .or_default()
                .push(id.to_vec());
        }
    }

    /// Adds the entries to their buckets: one read and one write per bucket.
    /// A bucket holds at most [`BUCKET_IDS_MAX`] ids; the rest of its
    /// millisecond (a burst, a clock step) are keys of their own.
    fn write(self, tree: &sled::Tree) -> Result<(), LedgerError> {
        for (bucket, mut added) in self.ids {
            let held = tree.get(&bucket)?;
            let held_ids = held.as_deref().map(keys::bucket_ids).unwrap_or_default();
            added.sort_unstable();
            added.retain(|id| !held_ids.contains(&id.as_slice()));
            let room = BUCKET_IDS_MAX
                .saturating_sub(held_ids.len())
                .min(added.len());
            let (into_bucket, own_keys) = added.split_at(room);
            if !into_bucket.is_empty() {
                let ids = held_ids
                    .iter()
                    .copied()
                    .chain(into_bucket.iter().map(Vec::as_slice));
                tree.insert(&bucket, keys::bucket_value(ids))?;
            }
            for id in own_keys {
                tree.insert([bucket.as_slice(), id].concat(), &[])?;
            }
        }
        Ok(())
    }
}

/// The most ids one bucket holds: its value is rewritten whole whenever a
/// chunk adds to it, and read whole by ListTasks.
const BUCKET_IDS_MAX: usize = 128;

/// A by-state key of a terminal state as its bucket's key and its task id;
/// `None` for any other index key, which is a sled key of its own, and for
/// a task without a status time or with an id too long for a bucket.
fn bucket_entry(key: &[u8]) -> Option<(&[u8], &[u8])> {
    let (_, state, suffix_at) = keys::by_state_parts(key)?;
    let id_at = suffix_at + keys::ORDER_TIME_LEN;
    let terminal = is_bucketed_state(state);
    let timed = key
        .get(suffix_at..id_at)
        .is_some_and(|time| time != keys::NO_TIME);
    let id_len = key.len().saturating_sub(id_at);
    (terminal && timed && id_len > 0 && id_len <= usize::from(u16::MAX))
        .then(|| key.split_at(id_at))
}

/// Whether by-state entries in `state` (a state number) go in buckets: a
/// terminal state, which a task never leaves.
pub fn is_bucketed_state(state: u8) -> bool {
    TaskState::from_number(i64::from(state)).is_some_and(TaskState::is_terminal)
}

/// Removes one index entry: its own key, or its id from its bucket (and
/// the bucket once empty). A terminal entry of an older ledger is a key of
/// its own: both are removed.
fn remove_index_key(tree: &sled::Tree, key: &[u8]) -> Result<(), LedgerError> {
    if let Some((bucket, id)) = bucket_entry(key)
        && let Some(held) = tree.get(bucket)?
    {
        let ids = keys::bucket_ids(&held);
        if ids.contains(&id) {
            let rest: Vec<&[u8]> = ids.into_iter().filter(|held| *held != id).collect();
            if rest.is_empty() {
                tree.remove(bucket)?;
            } else {
                tree.insert(bucket, keys::bucket_value(rest))?;
            }
        }
    }
    tree.remove(key)?;
    Ok(())
}

/// The intent of applying some tasks: each task id with the index keys it
/// adds, as byte strings each after its u32 length, and a u32 key count
/// after each id.
fn encode_intent<'a>(tasks: impl Iterator<Item = (&'a str, &'a Vec<Vec<u8>>)>) -> Vec<u8> {
    let mut intent = Vec::new();
    let mut put = |part: &[u8]| {
        intent.extend_from_slice(&(part.len() as u32).to_be_bytes());
        intent.extend_from_slice(part);
    };
    for (task_id, index) in tasks {
        put(task_id.as_bytes());
        put(&(index.len() as u32).to_be_bytes());
        for key in index {
            put(key);
        }
    }
    intent
}

/// The tasks and index keys of an intent; a cut-short one ends early.
fn decode_intent(mut intent: &[u8]) -> Vec<(String, Vec<Vec<u8>>)> {
    let mut take = || -> Option<Vec<u8>> {
        let (len, rest) = intent.split_first_chunk::<4>()?;
        let len = u32::from_be_bytes(*len) as usize;
        let (part, rest) = rest.split_at_checked(len)?;
        intent = rest;
        Some(part.to_vec())
    };
    let mut tasks = Vec::new();
    while let Some(id) = take() {
        let Some(count) = take().and_then(|c| <[u8; 4]>::try_from(c).ok()) else {
            break;
        };
        let keys: Option<Vec<_>> = (0..u32::from_be_bytes(count)).map(|_| take()).collect();
        let Some(keys) = keys else {
            break;
        };
        tasks.push((String::from_utf8_lossy(&id).into_owned(), keys));
    }
    tasks
}

/// What the applier needs of a record already in sled: its version, how
/// far its events go, and what its index keys were built from. Decoding
/// only this skips the history and artifacts of every task it re-applies.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct AppliedHead {
    version: u64,
    last_seq: u64,
    owner: String,
    task: AppliedTask,
}

/// The index fields of an applied task.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct AppliedTask {
    #[serde(default)]
    id: String,
    #[serde(default)]
    context_id: String,
    #[serde(default)]
    status: AppliedStatus,
}

/// The index fields of an applied task's status.
#[derive(Default, serde::Deserialize)]
struct AppliedStatus {
    #[serde(default)]
    state: TaskState,
    #[serde(default, with = "crate::protocol::wire::opt_timestamp")]
    timestamp: Option<chrono::DateTime<chrono::Utc>>,
}

impl AppliedHead {
    /// The index keys the record was applied with.
    fn index_keys(&self) -> Vec<Vec<u8>> {
        let task = &self.task;
        index_keys(
            &self.owner,
            &task.id,
            &task.context_id,
            task.status.state,
            task.status.timestamp,
        )
    }
}

/// Removes the index entries of a task's previous state that its new one
/// (`kept`, its index keys) does not have.
fn index_remove(
    tree: &sled::Tree,
    counts: &mut CounterDeltas,
    record: &AppliedHead,
    kept: &[Vec<u8>],
) -> Result<(), LedgerError> {
    for key in record.index_keys() {
        if !kept.contains(&key) {
            remove_index_key(tree, &key)?;
        }
    }
    let state = record.task.status.state.number();
    *counts.owner(&record.owner).states.entry(state).or_default() -= 1;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// The log segments this thread deleted durably, in order.
        pub(super) static DELETED_DURABLY: std::cell::RefCell<Vec<PathBuf>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }

    fn count(tree: &sled::Tree, owner: &str, name: &str) -> u64 {
        read_counter(tree, &keys::counter(owner, name)).unwrap()
    }

    fn count_in_state(tree: &sled::Tree, owner: &str, state: u8) -> u64 {
        read_counter(tree, &keys::state_counter(owner, state)).unwrap()
    }

    /// An applier over a fresh sled in `dir`, its thread not started.
    fn unstarted_applier(dir: &std::path::Path) -> Arc<Applier> {
        let db = sled::Config::new().path(dir).open().unwrap();
        let tree = db.open_tree("ledger").unwrap();
        Applier::new(db, tree, dir.join("wal"), Arc::default()).unwrap()
    }

    /// Queues the creation of `record`, with no events, as an unstarted
    /// applier's tests write: the log is durable up to ticket 0 already.
    fn queue_created(applier: &Applier, record: Arc<TaskRecord>) {
        applier.add_task(record, None, &[], 0, true);
    }

    /// Applies what is pending, then one more set, and checks that `first`
    /// (in the first set) was freed by then without any writer freeing it.
    fn assert_freed_by_the_applier(applier: &Applier, first: &Arc<TaskRecord>) {
        applier.apply_pending().unwrap();
        let next = stored("u1", TaskState::Working, 1);
        queue_created(applier, Arc::new(next));
        applier.apply_pending().unwrap();
        assert_eq!(Arc::strong_count(first), 1, "freed with its set");
    }

    #[test]
    fn segments_are_deleted_in_order_and_kept_from_the_first_that_fails() {
        let paths: Vec<PathBuf> = ["1.log", "2.log", "3.log", "4.log"]
            .iter()
            .map(PathBuf::from)
            .collect();
        let mut tried = Vec::new();
        let kept = delete_in_order(paths.clone(), |path| {
            tried.push(path.to_path_buf());
            match path.to_str() {
                Some("1.log") => Err(std::io::ErrorKind::NotFound.into()),
                Some("3.log") => Err(std::io::ErrorKind::PermissionDenied.into()),
                _ => Ok(()),
            }
        });
        assert_eq!(kept, paths[2..], "the failed segment and those after it");
        assert_eq!(tried, paths[..3], "none deleted past the failure");
        assert!(delete_in_order(paths, |_| Ok(())).is_empty());
    }

    #[test]
    fn start_up_deletes_the_replayed_segments_oldest_first_each_durably() {
        let dir = tempfile::tempdir().unwrap();
        let (db, tree, wal_dir) = store_with_log_dir(dir.path());
        for number in 1..=3 {
            wal::Segment::create(&wal_dir, number).unwrap();
        }
        let replayed: Vec<PathBuf> = wal::segments(&wal_dir)
            .unwrap()
            .into_iter()
            .map(|(_, path)| path)
            .collect();
        let applier = Applier::new(db, tree, wal_dir.clone(), Arc::default()).unwrap();
        applier.recover(PendingSet::default()).unwrap();
        assert!(wal::segments(&wal_dir).unwrap().is_empty());
        assert_eq!(DELETED_DURABLY.take(), replayed);
    }

    #[test]
    fn an_applied_set_is_read_until_the_next_and_then_freed_by_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let first = Arc::new(stored("t1", TaskState::Completed, 1));
        queue_created(&applier, first.clone());
        applier.apply_pending().unwrap();
        assert!(applier.task("t1").is_some(), "the set applied last is read");

        let second = Arc::new(stored("t2", TaskState::Completed, 1));
        queue_created(&applier, second);
        applier.apply_pending().unwrap();
        assert!(applier.task("t1").is_none(), "sled has t1 now");
        assert!(applier.task("t2").is_some());
        assert_eq!(
            Arc::strong_count(&first),
            2,
            "the applier must not free the set it replaced"
        );
        applier.free_spent();
        assert_eq!(Arc::strong_count(&first), 1, "the next writer frees it");
    }

    #[test]
    fn an_idle_applier_frees_the_sets_it_applied() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let applied: Vec<Arc<TaskRecord>> = ["t1", "t2"]
            .map(|id| Arc::new(stored(id, TaskState::Completed, 1)))
            .into();
        for record in &applied {
            queue_created(&applier, record.clone());
            applier.apply_pending().unwrap();
        }
        // t1's set waits for a writer to free it, t2's is kept for reads.
        assert!(applied.iter().all(|record| Arc::strong_count(record) == 2));
        applier.start();
        let deadline = std::time::Instant::now() + 5 * IDLE_RELEASE;
        while applied.iter().any(|record| Arc::strong_count(record) > 1)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(applied.iter().all(|record| Arc::strong_count(record) == 1));
        assert!(applier.task("t2").is_none(), "sled serves it now");
        applier.stop();
    }

    #[test]
    fn a_large_applied_set_is_freed_by_the_applier() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let first = Arc::new(stored("t0", TaskState::Completed, 1));
        queue_created(&applier, first.clone());
        for n in 1..=SPENT_BY_WRITERS_MAX {
            let record = stored(&format!("t{n}"), TaskState::Completed, 1);
            queue_created(&applier, Arc::new(record));
        }
        assert_freed_by_the_applier(&applier, &first);
    }

    #[test]
    fn a_set_of_many_writes_to_few_tasks_is_freed_by_the_applier() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let first = Arc::new(stored("t0", TaskState::Working, 1));
        queue_created(&applier, first.clone());
        for version in 2..=SPENT_BY_WRITERS_MAX as u64 + 1 {
            let record = stored("t1", TaskState::Working, version);
            applier.add_task(Arc::new(record), None, &[], 0, version == 2);
        }
        assert_freed_by_the_applier(&applier, &first);
    }

    #[test]
    fn counter_changes_are_summed_per_owner_and_state_and_drop_to_nothing() {
        let mut counts = CounterDeltas::default();
        for (owner, state, delta) in [
            ("a", 3, 1),
            ("a", 3, 1),
            ("a", 2, 1),
            ("a", 2, -1),
            ("b", 3, 1),
        ] {
            *counts.owner(owner).states.entry(state).or_default() += delta;
        }
        counts.owner("a").all += 2;
        let mut changes: Vec<_> = counts.into_changes().collect();
        changes.sort();
        let mut expected = vec![
            (keys::state_counter("a", 3), 2),
            (keys::counter("a", "all"), 2),
            (keys::state_counter("b", 3), 1),
        ];
        expected.sort();
        assert_eq!(changes, expected);
    }

    fn stored(task_id: &str, state: TaskState, version: u64) -> TaskRecord {
        let mut record = TaskRecord {
            owner: "alice".into(),
            version,
            ..TaskRecord::default()
        };
        record.task.id = task_id.into();
        record.task.context_id = "ctx".into();
        record.task.status = crate::protocol::TaskStatus::now(state, None);
        record
    }

    #[test]
    fn a_scan_waiting_for_an_application_leaves_the_runtime_worker_to_other_tasks() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::Config::new().path(dir.path()).open().unwrap();
        let tree = db.open_tree("ledger").unwrap();
        let applier = Applier::new(db, tree, dir.path().join("wal"), Arc::default()).unwrap();
        // An application in progress on the applier thread, until the other
        // task is done (or 2 s, when a blocked worker never lets it finish).
        let (held, hold) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let applying = applier.clone();
        let application = std::thread::spawn(move || {
            let _guard = applying.apply_lock.write().unwrap();
            held.send(()).unwrap();
            let _ = released.recv_timeout(Duration::from_secs(2));
        });
        hold.recv().unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (scan_done, other_done) = runtime.block_on(async {
            let scanning = applier.clone();
            let scan = tokio::spawn(async move {
                drop(scanning.applied().unwrap());
                std::time::Instant::now()
            });
            let other = tokio::spawn(async {
                tokio::time::sleep(Duration::from_millis(5)).await;
                std::time::Instant::now()
            });
            let other_done = other.await.unwrap();
            let _ = release.send(());
            (scan.await.unwrap(), other_done)
        });
        application.join().unwrap();
        assert!(other_done < scan_done, "the other task waited for the scan");
    }

    #[test]
    fn blocking_work_runs_in_any_context() {
        assert_eq!(off_the_runtime(|| 1), 1);
        let current = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(current.block_on(async { off_the_runtime(|| 2) }), 2);
    }

    /// Every index entry in sled as a key of its own, bucket entries too,
    /// sorted.
    fn index_entries(tree: &sled::Tree) -> Vec<Vec<u8>> {
        let mut entries: Vec<Vec<u8>> = [&b"is\0"[..], b"ic\0", b"a\0", b"w\0"]
            .iter()
            .flat_map(|prefix| tree.scan_prefix(prefix))
            .flat_map(|entry| {
                let (key, value) = entry.unwrap();
                match keys::by_state_parts(&key) {
                    Some((_, _, at)) if key.len() - at == keys::ORDER_TIME_LEN => {
                        keys::bucket_ids(&value)
                            .into_iter()
                            .map(|id| [&key[..], id].concat())
                            .collect()
                    }
                    _ => vec![key.to_vec()],
                }
            })
            .collect();
        entries.sort();
        entries
    }

    /// A sled store in `dir`, with its (empty) log directory.
    fn store_with_log_dir(dir: &std::path::Path) -> (sled::Db, sled::Tree, PathBuf) {
        let wal_dir = dir.join("wal");
        std::fs::create_dir_all(&wal_dir).unwrap();
        let db = sled::Config::new().path(dir).open().unwrap();
        let tree = db.open_tree("ledger").unwrap();
        (db, tree, wal_dir)
    }

    #[test]
    fn an_application_cut_short_is_repaired_at_start_up() {
        let dir = tempfile::tempdir().unwrap();
        let (db, tree, wal_dir) = store_with_log_dir(dir.path());
        // t2 reached sled earlier, WORKING.
        let applied = stored("t2", TaskState::Working, 1);
        tree.insert(keys::task("t2"), serde_json::to_vec(&applied).unwrap())
            .unwrap();
        // The process stopped while applying t1's creation (WORKING) and t2
        // moving to INPUT_REQUIRED: their intent and new index keys are in
        // sled, t2's old keys are gone, and neither record is in.
        let created = stored("t1", TaskState::Working, 1);
        let moved = stored("t2", TaskState::InputRequired, 2);
        let mut cut_short = PendingSet::default();
        cut_short.add_task(Arc::new(created.clone()), None, &[], true, 0);
        cut_short.add_task(Arc::new(moved.clone()), None, &[], false, 0);
        let indexed: Vec<_> = cut_short
            .tasks
            .iter()
            .map(|(id, pending)| (id.as_str(), record_index_keys(&pending.record)))
            .collect();
        let intent = encode_intent(indexed.iter().map(|(id, index)| (*id, index)));
        tree.insert(keys::applying(), intent).unwrap();
        for key in record_index_keys(&created)
            .into_iter()
            .chain(record_index_keys(&moved))
        {
            tree.insert(key, &[]).unwrap();
        }
        // The log ends with both COMPLETED.
        let log = [
            stored("t1", TaskState::Completed, 2),
            stored("t2", TaskState::Completed, 3),
        ];
        let mut expected: Vec<Vec<u8>> = log.iter().flat_map(record_index_keys).collect();
        let applier = Applier::new(db.clone(), tree.clone(), wal_dir, Arc::default()).unwrap();
        applier
            .recover(PendingSet::from_log(logged(log), |id| applier.stored_task(id)).unwrap())
            .unwrap();
        expected.sort();
        assert_eq!(index_entries(&tree), expected);
        let completed = TaskState::Completed.number();
        assert_eq!(count(&tree, "alice", "all"), 2);
        assert_eq!(count_in_state(&tree, "alice", completed), 2);
        let working = TaskState::Working.number();
        assert_eq!(count_in_state(&tree, "alice", working), 0);
        let intent = tree.get(keys::applying()).unwrap();
        assert_eq!(
            intent.as_deref(),
            Some(&[][..]),
            "no application in progress"
        );
    }

    #[test]
    fn terminal_tasks_of_one_millisecond_share_one_key_until_they_leave_it() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let at = chrono::DateTime::from_timestamp(1_700_000_000, 5_000_000);
        let in_state = |id: &str, state| {
            let mut record = stored(id, state, 1);
            record.task.status.timestamp = at;
            record
        };
        let records = [
            in_state("t1", TaskState::Completed),
            in_state("t2", TaskState::Completed),
            in_state("t3", TaskState::Completed),
            in_state("t4", TaskState::Working),
        ];
        for record in &records {
            queue_created(&applier, Arc::new(record.clone()));
        }
        applier.apply_pending().unwrap();

        let tree = &applier.tree;
        let completed = TaskState::Completed.number();
        let completed_prefix = keys::by_state_prefix("alice", completed);
        assert_eq!(tree.scan_prefix(&completed_prefix).count(), 1, "one bucket");
        let mut expected: Vec<Vec<u8>> = records.iter().flat_map(record_index_keys).collect();
        expected.sort();
        assert_eq!(index_entries(tree), expected);
        assert_eq!(count_in_state(tree, "alice", completed), 3);

        // An entry leaves its bucket (a crash repaired, a status re-stamped);
        // the bucket goes with its last entry.
        let entry = |id: &str| {
            record_index_keys(&in_state(id, TaskState::Completed))
                .into_iter()
                .next()
                .unwrap()
        };
        remove_index_key(tree, &entry("t2")).unwrap();
        let (_, bucket) = tree.scan_prefix(&completed_prefix).next().unwrap().unwrap();
        assert_eq!(keys::bucket_ids(&bucket), vec![b"t1".as_slice(), b"t3"]);
        remove_index_key(tree, &entry("t1")).unwrap();
        remove_index_key(tree, &entry("t3")).unwrap();
        assert_eq!(tree.scan_prefix(&completed_prefix).count(), 0);
        let removed = ["t1", "t2", "t3"].map(entry);
        expected.retain(|key| !removed.contains(key));
        assert_eq!(index_entries(tree), expected);
    }

    /// `task_id` in `state` at 1 700 000 000 s plus `micros`, version `version`.
    fn stamped(task_id: &str, state: TaskState, version: u64, micros: i64) -> TaskRecord {
        let mut record = stored(task_id, state, version);
        record.task.status.timestamp =
            chrono::DateTime::from_timestamp_micros(1_700_000_000_000_000 + micros);
        record
    }

    #[test]
    fn a_terminal_task_restamped_in_its_millisecond_stays_in_its_bucket() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let first = stamped("t1", TaskState::Completed, 1, 5_000);
        queue_created(&applier, Arc::new(first));
        applier.apply_pending().unwrap();
        let restamped = stamped("t1", TaskState::Completed, 2, 5_400);
        applier.add_task(Arc::new(restamped.clone()), None, &[], 0, false);
        applier.apply_pending().unwrap();
        let mut expected = record_index_keys(&restamped);
        expected.sort();
        assert_eq!(index_entries(&applier.tree), expected);
    }

    #[test]
    fn a_full_bucket_leaves_the_rest_of_its_millisecond_to_keys_of_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        // Two sets, so that the second adds to a bucket sled holds.
        let records: Vec<TaskRecord> = (0..BUCKET_IDS_MAX + 40)
            .map(|n| stamped(&format!("t{n:03}"), TaskState::Failed, 1, 7_000))
            .collect();
        let (first, second) = records.split_at(100);
        for set in [first, second] {
            for record in set {
                queue_created(&applier, Arc::new(record.clone()));
            }
            applier.apply_pending().unwrap();
        }
        let tree = &applier.tree;
        let prefix = keys::by_state_prefix("alice", TaskState::Failed.number());
        let (buckets, own): (Vec<_>, Vec<_>) = tree
            .scan_prefix(&prefix)
            .map(|entry| entry.unwrap())
            .partition(|(key, _)| keys::is_bucket_suffix(&key[prefix.len()..]));
        assert_eq!(buckets.len(), 1);
        assert_eq!(keys::bucket_ids(&buckets[0].1).len(), BUCKET_IDS_MAX);
        assert_eq!(own.len(), 40);
        let mut expected: Vec<Vec<u8>> = records.iter().flat_map(record_index_keys).collect();
        expected.sort();
        assert_eq!(index_entries(tree), expected);
        assert_eq!(
            count_in_state(tree, "alice", TaskState::Failed.number()),
            records.len() as u64
        );
    }

    #[test]
    fn a_terminal_task_without_a_status_time_is_not_bucketed() {
        let mut record = stored("t1", TaskState::Canceled, 1);
        record.task.status.timestamp = None;
        let by_state = record_index_keys(&record).remove(0);
        assert!(bucket_entry(&by_state).is_none());
        assert!(
            bucket_entry(&record_index_keys(&stamped("t1", TaskState::Canceled, 1, 0))[0])
                .is_some()
        );
    }

    #[test]
    fn a_bucket_written_by_an_application_cut_short_is_repaired_at_start_up() {
        let dir = tempfile::tempdir().unwrap();
        let (db, tree, wal_dir) = store_with_log_dir(dir.path());
        let applier =
            Applier::new(db.clone(), tree.clone(), wal_dir.clone(), Arc::default()).unwrap();
        // x is applied, COMPLETED in bucket M.
        let x = stamped("x", TaskState::Completed, 1, 9_000);
        queue_created(&applier, Arc::new(x.clone()));
        applier.apply_pending().unwrap();
        // Then an application stopped after writing y's and z's entries into
        // M, before either record: y new, z moving WORKING -> COMPLETED.
        let z_before = stamped("z", TaskState::Working, 1, 1_000);
        tree.insert(keys::task("z"), serde_json::to_vec(&z_before).unwrap())
            .unwrap();
        for key in record_index_keys(&z_before) {
            tree.insert(key, &[]).unwrap();
        }
        let y = stamped("y", TaskState::Completed, 1, 9_100);
        let z = stamped("z", TaskState::Completed, 2, 9_200);
        let cut_short: Vec<(String, Vec<Vec<u8>>)> = [&y, &z]
            .iter()
            .map(|record| (record.task.id.clone(), record_index_keys(record)))
            .collect();
        tree.insert(
            keys::applying(),
            encode_intent(cut_short.iter().map(|(id, index)| (id.as_str(), index))),
        )
        .unwrap();
        let mut buckets = BucketAdditions::default();
        for (_, index) in &cut_short {
            buckets.note(index);
        }
        buckets.write(&tree).unwrap();
        drop(applier);

        // The log holds z's write only.
        let applier = Applier::new(db.clone(), tree.clone(), wal_dir, Arc::default()).unwrap();
        applier
            .recover(
                PendingSet::from_log(logged([z.clone()]), |id| applier.stored_task(id)).unwrap(),
            )
            .unwrap();
        let mut expected: Vec<Vec<u8>> = [&x, &z].into_iter().flat_map(record_index_keys).collect();
        expected.sort();
        assert_eq!(index_entries(&tree), expected, "y is gone, z moved");
        let completed = TaskState::Completed.number();
        assert_eq!(count_in_state(&tree, "alice", completed), 2);
        assert_eq!(
            count_in_state(&tree, "alice", TaskState::Working.number()),
            0
        );
        assert_eq!(count(&tree, "alice", "all"), 2);
    }

    #[test]
    fn counters_are_rebuilt_from_the_by_state_index() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::Config::new().path(dir.path()).open().unwrap();
        let tree = db.open_tree("ledger").unwrap();
        let working = TaskState::Working.number();
        let completed = TaskState::Completed.number();
        for (owner, state, id) in [
            ("alice", working, "t1"),
            ("alice", completed, "t2"),
            ("alice", completed, "t3"),
            ("bob", working, "t4"),
        ] {
            let order = keys::order(None, id);
            tree.insert([keys::by_state_prefix(owner, state), order].concat(), &[])
                .unwrap();
        }
        // Two more COMPLETED tasks in one bucket, one of them also a key of
        // its own (spilled, then re-stamped into the bucket).
        let time = chrono::DateTime::from_timestamp(1_700_000_000, 0);
        let bucket = [
            keys::by_state_prefix("alice", completed),
            keys::order(time, ""),
        ]
        .concat();
        tree.insert(&bucket, keys::bucket_value([b"t5".as_slice(), b"t6"]))
            .unwrap();
        tree.insert([bucket.as_slice(), b"t6"].concat(), &[])
            .unwrap();
        // Counters a half-applied set left wrong, one for an owner with no
        // tasks left, and an unused context counter of an older ledger.
        let wrong = 7u64.to_be_bytes();
        tree.insert(keys::counter("alice", "all"), &wrong).unwrap();
        tree.insert(keys::state_counter("alice", completed), &wrong)
            .unwrap();
        tree.insert(keys::counter("carol", "all"), &wrong).unwrap();
        let legacy = keys::counter("alice", "cctx");
        tree.insert(legacy.clone(), &wrong).unwrap();

        recount(&tree).unwrap();
        assert_eq!(count(&tree, "alice", "all"), 5);
        assert_eq!(count_in_state(&tree, "alice", completed), 4);
        assert_eq!(count_in_state(&tree, "alice", working), 1);
        assert_eq!(count(&tree, "bob", "all"), 1);
        assert_eq!(tree.get(keys::counter("carol", "all")).unwrap(), None);
        assert_eq!(tree.get(&legacy).unwrap().as_deref(), Some(&wrong[..]));
    }

    /// The log as it holds writes of `records`, without events.
    fn logged(records: impl IntoIterator<Item = TaskRecord>) -> Vec<wal::Entry> {
        records
            .into_iter()
            .map(|record| wal::Entry::Task {
                record: Box::new(record),
                events: Vec::new(),
            })
            .collect()
    }

    /// A write that made `after` of `before`, logged as what it added and
    /// read back as start-up reads it.
    fn logged_additions(before: &TaskRecord, after: &TaskRecord) -> wal::Entry {
        let additions = append::additions(&before.task, &after.task).expect("additions");
        let head = append::head_json(&mut after.clone()).unwrap();
        let entry = wal::EntryRef::TaskAppend {
            head: &head,
            history_from: additions.history_from,
            history: &after.task.history[additions.history_from..],
            artifacts: &additions.artifacts,
            events: Vec::new(),
        };
        let mut frame = Vec::new();
        wal::encode(&mut frame, &entry).unwrap();
        super::super::decode_stored(&frame[8..]).unwrap()
    }

    #[test]
    fn a_logged_addition_is_rebuilt_on_the_write_before_it_from_the_log_or_sled() {
        // Version n holds n parts of one artifact.
        let version = |n: usize| TaskRecord {
            task: crate::protocol::Task {
                id: "t1".into(),
                artifacts: vec![crate::protocol::Artifact {
                    artifact_id: "a1".into(),
                    parts: (0..n)
                        .map(|i| crate::protocol::Part::text(format!("p{i}")))
                        .collect(),
                    ..Default::default()
                }],
                ..Default::default()
            },
            version: n as u64,
            ..TaskRecord::default()
        };
        let (v1, v2, v3) = (version(1), version(2), version(3));
        let rebuilt = |log, in_sled: Option<&TaskRecord>| {
            let mut reads = 0;
            let set = PendingSet::from_log(log, |_| {
                reads += 1;
                Ok(in_sled.cloned())
            })
            .unwrap();
            let record = set.tasks.get("t1").map(|pending| (*pending.record).clone());
            (record, reads)
        };
        // On the log's own write before it.
        let mut log = logged([v1.clone()]);
        log.extend([logged_additions(&v1, &v2), logged_additions(&v2, &v3)]);
        assert_eq!(rebuilt(log, None), (Some(v3.clone()), 0));
        // On sled's record, read once.
        let log = || vec![logged_additions(&v1, &v2), logged_additions(&v2, &v3)];
        assert_eq!(rebuilt(log(), Some(&v1)), (Some(v3.clone()), 1));
        // sled holding one write already, or both: only what it lacks.
        assert_eq!(rebuilt(log(), Some(&v2)), (Some(v3.clone()), 1));
        assert_eq!(rebuilt(log(), Some(&v3)), (None, 1));
        // Nothing it fits (only lost data does this): the task is left as it was.
        assert_eq!(
            rebuilt(vec![logged_additions(&v2, &v3)], Some(&v1)),
            (None, 1)
        );
        assert_eq!(rebuilt(log(), None), (None, 1));
    }

    /// Queues the creation of `record` with its JSON, as the ledger's writes are.
    fn queue_encoded(applier: &Applier, record: Arc<TaskRecord>, created: bool) {
        let json = serde_json::value::to_raw_value(&*record).unwrap();
        let task_json = serde_json::value::to_raw_value(&record.task)
            .unwrap()
            .into();
        let encoded = Encoded { json, task_json };
        applier.add_task(record, Some(encoded), &[], 0, created);
    }

    /// An applier (over a fresh sled in the returned directory) that has
    /// applied one COMPLETED task with a UUIDv7 id, into a record bucket.
    fn applied_in_a_bucket() -> (tempfile::TempDir, Arc<Applier>, TaskRecord) {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let record = stored(
            &keys::uuid_v7_at(1_767_000_000_000, 1),
            TaskState::Completed,
            1,
        );
        queue_encoded(&applier, Arc::new(record.clone()), true);
        applier.apply_pending().unwrap();
        (dir, applier, record)
    }

    /// Queues the creation of `count` COMPLETED tasks of millisecond
    /// `millis`, with UUIDv7 ids, applies them and returns their records.
    fn apply_completed(applier: &Applier, millis: u64, count: u16) -> Vec<TaskRecord> {
        let records: Vec<TaskRecord> = (0..count)
            .map(|n| stored(&keys::uuid_v7_at(millis, n), TaskState::Completed, 1))
            .collect();
        for record in &records {
            queue_encoded(applier, Arc::new(record.clone()), true);
        }
        applier.apply_pending().unwrap();
        records
    }

    fn read_stored(applier: &Applier, task_id: &str) -> Option<TaskRecord> {
        applier
            .stored_record(task_id, None)
            .unwrap()
            .map(|bytes| serde_json::from_slice(&bytes).unwrap())
    }

    /// Checks that `record` reads back alike alone and through `memo`.
    fn assert_reads_back(applier: &Applier, record: &TaskRecord, memo: &mut BucketMemo) {
        assert_eq!(read_stored(applier, &record.task.id).as_ref(), Some(record));
        let bytes = applier
            .stored_record(&record.task.id, Some(memo))
            .unwrap()
            .unwrap();
        assert_eq!(
            serde_json::from_slice::<TaskRecord>(&bytes).unwrap(),
            *record
        );
    }

    /// The record buckets of one creation millisecond: ids per bucket.
    fn record_buckets(applier: &Applier, task_id: &str) -> Vec<Vec<String>> {
        let prefix = keys::record_bucket_prefix(task_id).unwrap();
        applier
            .tree
            .scan_prefix(prefix)
            .map(|entry| {
                let (_, stored) = entry.unwrap();
                let value = open_bucket(&applier.records, stored).unwrap().unwrap();
                assert!(value.len() <= BUCKET_BYTES_MAX + BUCKET_RECORDS_MAX * 48);
                keys::bucket_records(&value)
                    .map(|(id, _)| String::from_utf8(id.to_vec()).unwrap())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn record_buckets_go_compressed_into_the_record_file_and_older_ones_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let millis = 1_767_000_000_000;
        let records = apply_completed(&applier, millis, 4);
        let tree = &applier.tree;
        let prefix = keys::record_bucket_prefix(&records[0].task.id).unwrap();
        let stored_buckets: Vec<(sled::IVec, sled::IVec)> =
            tree.scan_prefix(&prefix).map(Result::unwrap).collect();
        assert_eq!(stored_buckets.len(), 1);
        let (key, pointer) = stored_buckets[0].clone();
        let pointer = Pointer::decode(&pointer).expect("sled holds a pointer");
        let sealed = applier.records.read(&pointer).unwrap().unwrap();
        let plain = open_bucket(&applier.records, stored_buckets[0].1.clone())
            .unwrap()
            .unwrap();
        assert!(
            sealed.len() < plain.len(),
            "{} bytes stored for {} plain",
            sealed.len(),
            plain.len()
        );
        let mut memo = BucketMemo::default();
        for record in &records {
            assert_reads_back(&applier, record, &mut memo);
        }

        // Buckets as formats 1 and 2 stored them in sled, plain and
        // compressed, read as before.
        for (n, seal) in [false, true].into_iter().enumerate() {
            let old: Vec<TaskRecord> = (0..2)
                .map(|id| {
                    let id = keys::uuid_v7_at(millis + 1 + n as u64, id);
                    stored(&id, TaskState::Failed, 1)
                })
                .collect();
            let mut value = Vec::new();
            for record in &old {
                let json = serde_json::to_vec(record).unwrap();
                keys::push_bucket_record(&mut value, &record.task.id, &json);
            }
            let plain_len = value.len();
            let value = if seal {
                keys::seal_record_bucket(value)
            } else {
                value
            };
            assert_eq!(value.len() < plain_len, seal);
            let old_prefix = keys::record_bucket_prefix(&old[0].task.id).unwrap();
            tree.insert(
                [old_prefix, old[0].task.id.clone().into_bytes()].concat(),
                value,
            )
            .unwrap();
            for record in old {
                assert_eq!(read_stored(&applier, &record.task.id), Some(record));
            }
        }

        // A pointer whose bytes do not check is a storage failure, not a
        // missing task.
        let mut damaged = pointer.encode();
        damaged[13] ^= 1;
        tree.insert(&key, &damaged).unwrap();
        let error = applier
            .stored_record(&records[0].task.id, None)
            .unwrap_err();
        assert!(
            matches!(&error, LedgerError::CorruptBucket(key) if key.contains(&records[0].task.id)),
            "{error}"
        );
        // So is a compressed bucket in sled (format 2) that does not decode.
        tree.insert(&key, &sealed[..sealed.len() / 2]).unwrap();
        let error = applier
            .stored_record(&records[0].task.id, None)
            .unwrap_err();
        assert!(matches!(&error, LedgerError::CorruptBucket(_)), "{error}");
    }

    #[test]
    fn a_bucket_that_does_not_check_fails_only_the_lookups_it_might_answer() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let millis = 1_767_000_000_000;
        let id = |n| keys::uuid_v7_at(millis, n);
        let apply = |ns: &[u16]| -> Vec<TaskRecord> {
            let records: Vec<TaskRecord> = ns
                .iter()
                .map(|&n| stored(&id(n), TaskState::Completed, 1))
                .collect();
            for record in &records {
                queue_encoded(&applier, Arc::new(record.clone()), true);
            }
            applier.apply_pending().unwrap();
            records
        };
        // Two sets in one millisecond: the second's bucket is keyed between
        // the ids of the first's.
        let outer = apply(&[0, 4]);
        let inner = apply(&[2]);
        assert_eq!(
            record_buckets(&applier, &id(0)),
            [vec![id(0), id(4)], vec![id(2)]]
        );
        let prefix = keys::record_bucket_prefix(&id(2)).unwrap();
        let inner_key = [prefix, id(2).into_bytes()].concat();
        let mut damaged = applier.tree.get(&inner_key).unwrap().unwrap().to_vec();
        damaged[13] ^= 1;
        applier.tree.insert(&inner_key, damaged).unwrap();

        let mut memo = BucketMemo::default();
        for found in &outer {
            assert_reads_back(&applier, found, &mut memo);
        }
        // What the damaged bucket holds, or might (an id at or after its
        // first), is a storage failure, not a missing task.
        for unreadable in [inner[0].task.id.clone(), id(3)] {
            for memo in [None, Some(&mut memo)] {
                let error = applier.stored_record(&unreadable, memo).unwrap_err();
                assert!(
                    matches!(&error, LedgerError::CorruptBucket(key) if key.contains(&id(2))),
                    "{unreadable}: {error}"
                );
            }
        }
        // An id before its first it cannot hold.
        assert_eq!(applier.stored_record(&id(1), None).unwrap(), None);
        assert_eq!(
            applier.stored_record(&id(1), Some(&mut memo)).unwrap(),
            None
        );
    }

    #[test]
    fn finished_tasks_created_in_one_set_share_buckets_by_creation_millisecond() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let millis = 1_767_000_000_000;
        let mut records = Vec::new();
        let full = 3 * BUCKET_RECORDS_MAX;
        for n in 0..full as u16 {
            records.push(stored(
                &keys::uuid_v7_at(millis, 2 * n + 1),
                TaskState::Completed,
                1,
            ));
        }
        records.push(stored(
            &keys::uuid_v7_at(millis + 1, 0),
            TaskState::Rejected,
            1,
        ));
        // These keep keys of their own, between the others of their
        // millisecond: still open, no UUIDv7 id, too large.
        let working = stored(&keys::uuid_v7_at(millis, 10), TaskState::Working, 1);
        let named = stored("t1", TaskState::Completed, 1);
        let mut large = stored(&keys::uuid_v7_at(millis, 0), TaskState::Completed, 1);
        large.task.metadata = Some(
            serde_json::from_value(serde_json::json!({"pad": "x".repeat(BUCKET_BYTES_MAX)}))
                .unwrap(),
        );
        let own_keys = [working, named, large];
        for record in records.iter().chain(&own_keys) {
            queue_encoded(&applier, Arc::new(record.clone()), true);
        }
        applier.apply_pending().unwrap();
        let tree = &applier.tree;

        let buckets = record_buckets(&applier, &records[0].task.id);
        let sizes: Vec<usize> = buckets.iter().map(Vec::len).collect();
        assert_eq!(
            sizes, [BUCKET_RECORDS_MAX; 3],
            "at most {BUCKET_RECORDS_MAX} a bucket"
        );
        let mut bucketed: Vec<String> = buckets.concat();
        bucketed.sort();
        let mut expected: Vec<String> = records[..full].iter().map(|r| r.task.id.clone()).collect();
        expected.sort();
        assert_eq!(bucketed, expected, "each once, in id order");
        assert_eq!(record_buckets(&applier, &records[full].task.id).len(), 1);
        for record in &records {
            assert_eq!(tree.get(keys::task(&record.task.id)).unwrap(), None);
            assert_eq!(
                read_stored(&applier, &record.task.id).as_ref(),
                Some(record)
            );
        }
        for record in &own_keys {
            assert!(tree.get(keys::task(&record.task.id)).unwrap().is_some());
            assert_eq!(
                read_stored(&applier, &record.task.id).as_ref(),
                Some(record)
            );
        }
        for missing in [
            keys::uuid_v7_at(millis, 2),
            keys::uuid_v7_at(millis, 2 * full as u16 + 1),
            keys::uuid_v7_at(millis + 2, 1),
        ] {
            assert_eq!(read_stored(&applier, &missing), None);
        }
        assert_eq!(
            count_in_state(tree, "alice", TaskState::Completed.number()),
            full as u64 + 2
        );
    }

    #[test]
    fn a_set_larger_than_a_chunk_fills_each_millisecond_s_buckets() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let first_millis = 1_767_000_000_000;
        // Four chunks' worth, four tasks in each millisecond: whole
        // milliseconds per chunk make one full bucket each.
        let per_millis = BUCKET_RECORDS_MAX as u16;
        let milliseconds = (4 * TASKS_PER_INTENT) as u64 / u64::from(per_millis);
        let ids: Vec<String> = (0..milliseconds)
            .flat_map(|offset| {
                (0..per_millis).map(move |n| keys::uuid_v7_at(first_millis + offset, n))
            })
            .collect();
        for id in &ids {
            let record = stored(id, TaskState::Completed, 1);
            queue_encoded(&applier, Arc::new(record), true);
        }
        applier.apply_pending().unwrap();

        let buckets: usize = ids
            .iter()
            .step_by(usize::from(per_millis))
            .map(|first_of_millis| record_buckets(&applier, first_of_millis).len())
            .sum();
        assert_eq!(
            buckets as u64, milliseconds,
            "one full bucket a millisecond"
        );
        for id in ids.iter().step_by(97) {
            assert_eq!(read_stored(&applier, id).unwrap().task.id, *id);
        }
    }

    #[test]
    fn a_bucketed_task_written_again_gets_its_own_key_which_reads_prefer() {
        let (_dir, applier, first) = applied_in_a_bucket();
        let task_id = first.task.id.clone();
        assert_eq!(record_buckets(&applier, &task_id), [[task_id.clone()]]);

        let mut second = first.clone();
        second.version = 2;
        second.agent = "edited".into();
        queue_encoded(&applier, Arc::new(second.clone()), false);
        applier.apply_pending().unwrap();
        let tree = &applier.tree;
        assert!(tree.get(keys::task(&task_id)).unwrap().is_some());
        assert_eq!(read_stored(&applier, &task_id), Some(second));
        assert_eq!(
            record_buckets(&applier, &task_id),
            [[task_id.clone()]],
            "left as it was"
        );
        assert_eq!(
            count_in_state(tree, "alice", TaskState::Completed.number()),
            1
        );
    }

    #[test]
    fn a_replayed_log_and_a_crash_repair_find_records_in_buckets() {
        let (_dir, applier, record) = applied_in_a_bucket();
        let task_id = record.task.id.clone();
        let tree = &applier.tree;
        let index = record_index_keys(&record);

        // An interrupted application's intent names the task's index keys:
        // they match its record (in its bucket), so they stay.
        let intent = encode_intent([(task_id.as_str(), &index)].into_iter());
        applier.remove_stale_index_keys(&intent).unwrap();
        let state = TaskState::Completed.number();
        let prefix = keys::by_state_prefix("alice", state);
        assert_eq!(tree.scan_prefix(&prefix).count(), 1, "its index entry kept");

        // The log replayed holds the same version: sled is as new already.
        let log = logged([record.clone()]);
        applier
            .recover(PendingSet::from_log(log, |id| applier.stored_task(id)).unwrap())
            .unwrap();
        assert_eq!(
            tree.get(keys::task(&task_id)).unwrap(),
            None,
            "nothing re-applied"
        );
        assert_eq!(read_stored(&applier, &task_id), Some(record));
    }

    #[test]
    fn a_task_is_read_from_its_bucket_past_another_sets_buckets() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let millis = 1_767_000_000_000;
        let mut records = Vec::new();
        // Odd ids in one set, even ids in the next: their buckets interleave.
        for parity in [1, 0] {
            for n in 0..2 * BUCKET_RECORDS_MAX as u16 {
                let record = stored(
                    &keys::uuid_v7_at(millis, 2 * n + parity),
                    TaskState::Completed,
                    1,
                );
                queue_encoded(&applier, Arc::new(record.clone()), true);
                records.push(record);
            }
            applier.apply_pending().unwrap();
        }
        assert_eq!(record_buckets(&applier, &records[0].task.id).len(), 4);
        for record in &records {
            assert_eq!(
                read_stored(&applier, &record.task.id).as_ref(),
                Some(record)
            );
        }
    }

    #[test]
    fn a_bucket_lost_to_a_crash_is_repaired_into_a_key_of_its_own() {
        let (_dir, applier, record) = applied_in_a_bucket();
        let task_id = record.task.id.clone();
        let tree = &applier.tree;
        // The crash: the chunk's intent and index keys are in, its bucket is not.
        let index = record_index_keys(&record);
        let intent = encode_intent([(task_id.as_str(), &index)].into_iter());
        tree.insert(keys::applying(), intent).unwrap();
        let prefix = keys::record_bucket_prefix(&task_id).unwrap();
        let (bucket, _) = tree.scan_prefix(prefix).next().unwrap().unwrap();
        tree.remove(bucket).unwrap();

        let log = logged([record.clone()]);
        applier
            .recover(PendingSet::from_log(log, |id| applier.stored_task(id)).unwrap())
            .unwrap();
        assert!(tree.get(keys::task(&task_id)).unwrap().is_some());
        assert_eq!(read_stored(&applier, &task_id), Some(record));
        let state = TaskState::Completed.number();
        assert_eq!(count_in_state(tree, "alice", state), 1);
        assert_eq!(count(tree, "alice", "all"), 1);
        let prefix = keys::by_state_prefix("alice", state);
        let (_, entry) = tree.scan_prefix(&prefix).next().unwrap().unwrap();
        assert_eq!(keys::bucket_ids(&entry), [task_id.as_bytes()]);
    }

    /// How a crash left the record file's bytes past the synced length.
    #[derive(Clone, Copy)]
    enum LostTail {
        /// Gone: the file ends at the synced length.
        CutShort,
        /// Still as long, but zeros.
        Zeroed,
    }

    /// Applies three tasks and checkpoints, then three more whose bucket
    /// bytes a crash then loses (`tail`), and returns an applier started
    /// again over the same sled, not yet recovered, with both sets.
    fn crashed_with_lost_buckets(
        dir: &std::path::Path,
        tail: LostTail,
    ) -> (Arc<Applier>, Vec<TaskRecord>, Vec<TaskRecord>) {
        let applier = unstarted_applier(dir);
        let kept = apply_completed(&applier, 1_767_000_000_000, 3);
        applier.flush().unwrap();
        let lost = apply_completed(&applier, 1_767_000_000_001, 3);
        let synced = read_counter(&applier.tree, keys::records_synced()).unwrap();
        let end = applier.records.end();
        assert!(end > synced);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(RECORD_FILE))
            .unwrap();
        match tail {
            LostTail::CutShort => file.set_len(synced).unwrap(),
            LostTail::Zeroed => {
                use std::os::unix::fs::FileExt as _;
                file.write_all_at(&vec![0; (end - synced) as usize], synced)
                    .unwrap();
            }
        }
        let (db, tree) = (applier.db.clone(), applier.tree.clone());
        drop(applier);
        let restarted = Applier::new(db, tree, dir.join("wal"), Arc::default()).unwrap();
        (restarted, kept, lost)
    }

    /// Recovers `lost` from the log and checks every task reads back,
    /// counted once.
    fn assert_recovered(applier: &Applier, kept: &[TaskRecord], lost: &[TaskRecord]) {
        applier
            .recover(
                PendingSet::from_log(logged(lost.to_vec()), |id| applier.stored_task(id)).unwrap(),
            )
            .unwrap();
        for record in kept.iter().chain(lost) {
            assert_eq!(read_stored(applier, &record.task.id).as_ref(), Some(record));
        }
        let tree = &applier.tree;
        let state = TaskState::Completed.number();
        assert_eq!(count_in_state(tree, "alice", state), 6, "each counted once");
        assert_eq!(count(tree, "alice", "all"), 6);
        assert_eq!(record_buckets(applier, &kept[0].task.id).len(), 1);
        // Replayed records carry no JSON of their writer's: keys of their own.
        assert!(record_buckets(applier, &lost[0].task.id).is_empty());
        for record in lost {
            assert!(tree.get(keys::task(&record.task.id)).unwrap().is_some());
        }
        let synced = read_counter(tree, keys::records_synced()).unwrap();
        assert_eq!(synced, applier.records.end(), "synced at recovery's end");
        assert_eq!(
            tree.get(keys::applying()).unwrap().as_deref(),
            Some(&[][..])
        );
    }

    #[test]
    fn buckets_whose_bytes_a_crash_lost_are_applied_again_from_the_log() {
        for tail in [LostTail::CutShort, LostTail::Zeroed] {
            let dir = tempfile::tempdir().unwrap();
            let (restarted, kept, lost) = crashed_with_lost_buckets(dir.path(), tail);
            let unreadable = restarted.stored_record(&lost[0].task.id, None);
            assert!(matches!(unreadable, Err(LedgerError::CorruptBucket(_))));
            assert_recovered(&restarted, &kept, &lost);
        }
    }

    #[test]
    fn a_recovery_stopped_after_removing_lost_buckets_still_counts_each_task_once() {
        let dir = tempfile::tempdir().unwrap();
        let (restarted, kept, lost) = crashed_with_lost_buckets(dir.path(), LostTail::CutShort);
        // The first recovery removes the lost pointers, then stops.
        assert!(restarted.remove_lost_buckets().unwrap());
        let (db, tree) = (restarted.db.clone(), restarted.tree.clone());
        drop(restarted);
        let again = Applier::new(db, tree, dir.path().join("wal"), Arc::default()).unwrap();
        assert_recovered(&again, &kept, &lost);
    }

    #[test]
    fn a_record_file_missing_or_shorter_than_it_was_synced_to_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        apply_completed(&applier, 1_767_000_000_000, 3);
        applier.flush().unwrap();
        let (db, tree) = (applier.db.clone(), applier.tree.clone());
        drop(applier);
        std::fs::remove_file(dir.path().join(RECORD_FILE)).unwrap();
        let refused = Applier::new(
            db.clone(),
            tree.clone(),
            dir.path().join("wal"),
            Arc::default(),
        );
        let Err(err) = refused else {
            panic!("a lost record file must not open as an empty one");
        };
        assert!(err.to_string().contains("record file"), "{err}");
        assert!(err.to_string().contains("is missing"), "{err}");
        // Refused without creating one, so every start says the same.
        assert!(!dir.path().join(RECORD_FILE).exists());
        // One cut short is refused too.
        std::fs::write(dir.path().join(RECORD_FILE), b"short").unwrap();
        let Err(err) = Applier::new(db, tree, dir.path().join("wal"), Arc::default()) else {
            panic!("a truncated record file must not open");
        };
        assert!(err.to_string().contains("holds 5 bytes"), "{err}");
    }

    #[test]
    fn a_retried_application_leaves_the_buckets_it_wrote_as_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let records = apply_completed(&applier, 1_767_000_000_000, 6);
        let tree = &applier.tree;
        let prefix = keys::record_bucket_prefix(&records[0].task.id).unwrap();
        let written: Vec<_> = tree.scan_prefix(&prefix).map(Result::unwrap).collect();

        // The same set again, as a retry after a failure part way sees it.
        applier.partly_applied.store(true, Ordering::Relaxed);
        for record in &records {
            queue_encoded(&applier, Arc::new(record.clone()), true);
        }
        applier.apply_pending().unwrap();
        let after: Vec<_> = tree.scan_prefix(&prefix).map(Result::unwrap).collect();
        assert_eq!(after, written);
        for record in &records {
            assert_eq!(tree.get(keys::task(&record.task.id)).unwrap(), None);
        }
        let state = TaskState::Completed.number();
        assert_eq!(count_in_state(tree, "alice", state), 6);
        assert_eq!(count(tree, "alice", "all"), 6);
    }

    #[test]
    fn a_memo_of_buckets_serves_tasks_of_more_milliseconds_than_it_holds() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let millis = 1_767_000_000_000;
        let spread = BUCKET_MEMO_MILLIS as u64 + 4;
        let records: Vec<TaskRecord> = (0..spread * 2)
            .map(|n| {
                stored(
                    &keys::uuid_v7_at(millis + n % spread, n as u16),
                    TaskState::Failed,
                    1,
                )
            })
            .collect();
        for record in &records {
            queue_encoded(&applier, Arc::new(record.clone()), true);
        }
        applier.apply_pending().unwrap();
        let mut memo = BucketMemo::default();
        // Every millisecond twice, in turn: each read finds its task, held or not.
        for _ in 0..2 {
            for record in &records {
                let bytes = applier
                    .stored_record(&record.task.id, Some(&mut memo))
                    .unwrap()
                    .expect("found");
                let read: TaskRecord = serde_json::from_slice(&bytes).unwrap();
                assert_eq!(&read, record);
            }
        }
        assert_eq!(memo.millis.len(), BUCKET_MEMO_MILLIS);
        let missing = keys::uuid_v7_at(millis, 999);
        assert_eq!(
            applier.stored_record(&missing, Some(&mut memo)).unwrap(),
            None
        );
    }

    #[test]
    fn a_record_bucket_holds_at_most_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let applier = unstarted_applier(dir.path());
        let padded: Vec<TaskRecord> = (0..4)
            .map(|n| {
                let mut record = stored(
                    &keys::uuid_v7_at(1_767_000_000_000, n),
                    TaskState::Completed,
                    1,
                );
                let pad = serde_json::json!({"pad": "x".repeat(BUCKET_BYTES_MAX * 2 / 5)});
                record.task.metadata = Some(serde_json::from_value(pad).unwrap());
                record
            })
            .collect();
        for record in &padded {
            queue_encoded(&applier, Arc::new(record.clone()), true);
        }
        applier.apply_pending().unwrap();
        // Two fit in the bytes of one bucket, three do not.
        let sizes: Vec<usize> = record_buckets(&applier, &padded[0].task.id)
            .iter()
            .map(Vec::len)
            .collect();
        assert_eq!(sizes, [2, 2]);
        for record in &padded {
            assert_eq!(
                read_stored(&applier, &record.task.id).as_ref(),
                Some(record)
            );
        }
    }
}
