//! The task ledger: every gateway task, its event log, the ListTasks indexes,
//! push configs and idempotency records, in one sled database.
//!
//! Durability rule: a write returns only after the group-commit flusher has
//! flushed it, and its events reach watchers only after that flush. Writes
//! are serialized by one in-process lock (held for the in-memory sled work,
//! never across the flush), which keeps counters and event order exact.

pub mod flusher;
pub mod hub;
pub mod keys;

use crate::lifecycle::{self, TransitionError};
use crate::protocol::{StreamResponse, Task, TaskPushNotificationConfig, TaskState};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use flusher::Flusher;
use hub::{EventHub, LedgerEvent};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Ledger failures.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// No such task.
    #[error("task {0} not found")]
    NotFound(String),
    /// A task with this id exists already.
    #[error("task {0} exists already")]
    Exists(String),
    /// The lifecycle refused an event.
    #[error(transparent)]
    Transition(#[from] TransitionError),
    /// sled failed.
    #[error("storage: {0}")]
    Storage(#[from] sled::Error),
    /// A stored value did not decode.
    #[error("corrupt record: {0}")]
    Corrupt(#[from] serde_json::Error),
}

/// A gateway task as stored: the A2A task plus what the gateway knows of it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskRecord {
    /// The task as clients see it.
    pub task: Task,
    /// The principal that created it.
    pub owner: String,
    /// The agent currently responsible.
    pub agent: String,
    /// The task's ids at its agent, for agents that keep their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<crate::agents::UpstreamRef>,
    /// Bumped on every write.
    pub version: u64,
    /// Sequence number of the last event in the task's log.
    pub last_seq: u64,
    /// When the gateway created the task.
    pub created_at: DateTime<Utc>,
    /// The gateway task this one is a child of (a handoff's `parentTaskId`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_task_id: Option<String>,
    /// The JSON Schema the result must satisfy (a handoff's `returnSchema`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_schema: Option<serde_json::Value>,
    /// Every agent that has held this task, in order: the task's own part of
    /// the handoff graph, for `baton trace` and the metrics.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hops: Vec<HopRecord>,
    /// Where a transfer came from, while its target works on the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<TransferSource>,
}

/// How an agent came to hold a task.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HopKind {
    /// The caller addressed the agent, or it is the default.
    #[default]
    Call,
    /// The routing rules chose it.
    Routed,
    /// A message with a handoff payload named it (`to` or `toSkill`).
    Direct,
    /// The previous agent transferred the task to it.
    Transfer,
    /// The gateway returned a transfer's result to the agent that made it.
    Return,
    /// The ladder tried another agent with the skill after no acknowledgement.
    Reroute,
}

/// One agent's turn holding a task.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HopRecord {
    /// The agent.
    pub agent: String,
    /// How it got the task.
    pub kind: HopKind,
    /// When the gateway began delivering to it.
    pub started_at: DateTime<Utc>,
    /// When it acknowledged (its first answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acked_at: Option<DateTime<Utc>>,
    /// When its turn ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<DateTime<Utc>>,
    /// The state its turn ended in (the agent's state, which the caller may not see).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<TaskState>,
    /// A reason code, when one applies (`REROUTED`, `DEADLINE_EXCEEDED`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The agent's own task id, when it keeps one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_task_id: Option<String>,
    /// Size of the message built for it, in bytes of JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_bytes: Option<u64>,
    /// Delivery attempts made (1 unless the ladder retried).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempts: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The agent that transferred a task, kept while the target works, so the
/// result can return to it (`returnToParent`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TransferSource {
    /// The source agent.
    pub agent: String,
    /// The source's own task ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<crate::agents::UpstreamRef>,
    /// The state the source left its own task in.
    pub state: TaskState,
    /// The payload's `handoffId`.
    pub handoff_id: String,
    /// Whether the result goes back to the source.
    pub return_to_parent: bool,
    /// How many artifacts the task had before the target's turn: only the
    /// target's own are checked against the handoff's returnSchema.
    #[serde(default)]
    pub artifacts_before: usize,
}

/// What an idempotency key was first used for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IdempotencyRecord {
    /// Hash of the first message sent with the key.
    pub fingerprint: String,
    /// The task that send created (or was to create).
    pub task_id: String,
    /// The direct reply, when the agent answered with a message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<crate::protocol::Message>,
}

/// Filters of a ListTasks query, already validated.
#[derive(Clone, Debug, Default)]
pub struct ListQuery {
    /// Only this context.
    pub context_id: Option<String>,
    /// Only this state.
    pub state: Option<TaskState>,
    /// Only tasks whose status time is at or after this.
    pub status_after: Option<DateTime<Utc>>,
    /// Page size, 1..=100.
    pub page_size: usize,
    /// Cursor from the previous page.
    pub page_token: Option<Vec<u8>>,
}

/// One page of tasks.
#[derive(Debug, Default)]
pub struct ListPage {
    /// The page, newest status first.
    pub records: Vec<TaskRecord>,
    /// Cursor of the next page; empty on the last page.
    pub next_page_token: String,
    /// How many tasks match in all.
    pub total_size: usize,
}

/// Pending counter changes of one write, summed per counter.
type CounterDeltas = std::collections::HashMap<Vec<u8>, i64>;

/// Whether an agent is (or was, before a stop) working on a task in `state`.
fn is_active(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::Submitted | TaskState::Working | TaskState::Unspecified
    )
}

/// How a ListTasks query is served: the narrowest index, and what must
/// still be checked for each of its entries.
struct IndexPlan {
    prefix: Vec<u8>,
    /// A state filter the chosen index does not apply.
    check_state: Option<TaskState>,
    /// `statusTimestampAfter` in index precision, rounded up.
    after_millis: Option<u64>,
}

/// What an index entry means for a query.
enum Verdict {
    /// Past the time bound: nothing later in the index matches.
    Stop,
    /// Does not match.
    Skip,
    /// Matches; the record, if it had to be loaded.
    Match(Option<Box<TaskRecord>>),
}

impl IndexPlan {
    fn new(owner: &str, query: &ListQuery) -> Self {
        let (prefix, check_state) = match (&query.context_id, query.state) {
            (Some(context), state) => (keys::by_context_prefix(owner, context), state),
            (None, Some(state)) => (keys::by_state_prefix(owner, state.number()), None),
            (None, None) => (keys::by_time_prefix(owner), None),
        };
        Self {
            prefix,
            check_state,
            after_millis: query.status_after.map(after_millis),
        }
    }

    fn check(&self, ledger: &Ledger, suffix: &[u8]) -> Result<Verdict, LedgerError> {
        let Some((millis, task_id)) = keys::parse_order(suffix) else {
            return Ok(Verdict::Skip);
        };
        if self.after_millis.is_some_and(|after| millis < after) {
            return Ok(Verdict::Stop); // sorted newest first
        }
        let Some(state) = self.check_state else {
            return Ok(Verdict::Match(None));
        };
        Ok(match ledger.get(task_id)? {
            Some(record) if record.task.status.state == state => {
                Verdict::Match(Some(Box::new(record)))
            }
            _ => Verdict::Skip,
        })
    }
}

/// A timestamp in index precision (milliseconds), rounded up so that
/// "at or after" holds for the stored, millisecond-precise times.
fn after_millis(time: DateTime<Utc>) -> u64 {
    let micros = time.timestamp_micros().max(0) as u64;
    micros.div_ceil(1000)
}

/// Decodes and checks a ListTasks page token.
pub fn decode_page_token(token: &str) -> Option<Vec<u8>> {
    let bytes = URL_SAFE_NO_PAD.decode(token).ok()?;
    keys::parse_order(&bytes).map(|_| bytes.clone())
}

/// The durable task ledger.
pub struct Ledger {
    db: sled::Db,
    tree: sled::Tree,
    // std Mutex: guards in-memory sled work only; never held across .await.
    write_lock: Mutex<()>,
    flusher: Arc<Flusher>,
    hub: Arc<EventHub>,
}

impl Ledger {
    /// Opens (or creates) the ledger in `dir`.
    pub fn open(dir: &Path) -> Result<Self, LedgerError> {
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(64 * 1024 * 1024)
            .open()?;
        let tree = db.open_tree("ledger")?;
        let hub = Arc::new(EventHub::default());
        let flusher = Flusher::start(db.clone(), hub.clone());
        Ok(Self {
            db,
            tree,
            write_lock: Mutex::new(()),
            flusher,
            hub,
        })
    }

    /// Where durable events are fanned out.
    pub fn hub(&self) -> &Arc<EventHub> {
        &self.hub
    }

    /// Waits until every write made so far is on disk.
    pub async fn sync(&self) {
        let ticket = self.flusher.latest_ticket();
        self.flusher.wait_durable(ticket).await;
    }

    /// Flushes and stops the flusher; call once at shutdown.
    pub fn close(&self) {
        self.flusher.stop();
        let _ = self.db.flush();
    }

    /// Reads a task.
    pub fn get(&self, task_id: &str) -> Result<Option<TaskRecord>, LedgerError> {
        match self.tree.get(keys::task(task_id))? {
            Some(bytes) => Ok(Some(serde_json::from_slice(&bytes)?)),
            None => Ok(None),
        }
    }

    /// Creates a task and appends its first events, durably.
    pub async fn create(
        &self,
        mut record: TaskRecord,
        events: Vec<StreamResponse>,
    ) -> Result<TaskRecord, LedgerError> {
        let task_id = record.task.id.clone();
        let ticket = {
            let _guard = self.write_lock.lock().expect("ledger lock");
            if self.tree.contains_key(keys::task(&task_id))? {
                return Err(LedgerError::Exists(task_id));
            }
            let mut batch = sled::Batch::default();
            let published = self.append_events(&mut batch, &mut record, events)?;
            let mut counts = CounterDeltas::new();
            Self::index_insert(&mut batch, &mut counts, &record, true);
            if let Some(parent) = &record.parent_task_id {
                batch.insert(keys::child(parent, &task_id), &[]);
            }
            self.apply_counts(&mut batch, counts)?;
            record.version = 1;
            batch.insert(keys::task(&task_id), serde_json::to_vec(&record)?);
            self.tree.apply_batch(batch)?;
            self.flusher.note_write(published)
        };
        self.flusher.wait_durable(ticket).await;
        Ok(record)
    }

    /// Changes a task durably. `change` may edit the record (history, upstream
    /// ids) and returns the events to append; each event goes through the
    /// lifecycle rules. Nothing is written if `change` or a rule fails.
    pub async fn update<F, E>(&self, task_id: &str, change: F) -> Result<TaskRecord, E>
    where
        F: FnOnce(&mut TaskRecord) -> Result<Vec<StreamResponse>, E>,
        E: From<LedgerError>,
    {
        let (record, ticket) = {
            let _guard = self.write_lock.lock().expect("ledger lock");
            let before = self
                .get(task_id)?
                .ok_or_else(|| LedgerError::NotFound(task_id.to_string()))?;
            let mut record = before.clone();
            let events = change(&mut record)?;
            let mut batch = sled::Batch::default();
            let published = self.append_events(&mut batch, &mut record, events)?;
            let old = &before.task.status;
            let new = &record.task.status;
            if old.state != new.state || old.timestamp != new.timestamp {
                let mut counts = CounterDeltas::new();
                Self::index_remove(&mut batch, &mut counts, &before);
                Self::index_insert(&mut batch, &mut counts, &record, false);
                self.apply_counts(&mut batch, counts)?;
            }
            record.version += 1;
            batch.insert(
                keys::task(task_id),
                serde_json::to_vec(&record).map_err(LedgerError::from)?,
            );
            self.tree.apply_batch(batch).map_err(LedgerError::from)?;
            (record, self.flusher.note_write(published))
        };
        self.flusher.wait_durable(ticket).await;
        Ok(record)
    }

    fn append_events(
        &self,
        batch: &mut sled::Batch,
        record: &mut TaskRecord,
        events: Vec<StreamResponse>,
    ) -> Result<Vec<Arc<LedgerEvent>>, LedgerError> {
        let mut published = Vec::with_capacity(events.len());
        for event in events {
            lifecycle::apply_event(&mut record.task, &event)?;
            record.last_seq += 1;
            batch.insert(
                keys::event(&record.task.id, record.last_seq),
                serde_json::to_vec(&event)?,
            );
            published.push(Arc::new(LedgerEvent {
                task_id: record.task.id.clone(),
                seq: record.last_seq,
                event,
            }));
        }
        Ok(published)
    }

    /// Index entries of a task's current state, and the counter changes.
    fn index_insert(
        batch: &mut sled::Batch,
        counts: &mut CounterDeltas,
        record: &TaskRecord,
        new_task: bool,
    ) {
        let (owner, task) = (&record.owner, &record.task);
        let order = keys::order(task.status.timestamp, &task.id);
        let state = task.status.state.number();
        batch.insert([keys::by_time_prefix(owner), order.clone()].concat(), &[]);
        batch.insert(
            [keys::by_state_prefix(owner, state), order.clone()].concat(),
            &[],
        );
        batch.insert(
            [keys::by_context_prefix(owner, &task.context_id), order].concat(),
            &[],
        );
        if is_active(task.status.state) {
            batch.insert(keys::active(&task.id), &[]);
        }
        if task.status.state.is_interrupted() {
            batch.insert(keys::waiting(&task.id), &[]);
        }
        *counts
            .entry(keys::counter(owner, &format!("s{state}")))
            .or_default() += 1;
        if new_task {
            *counts.entry(keys::counter(owner, "all")).or_default() += 1;
            *counts
                .entry(keys::counter(owner, &format!("c{}", task.context_id)))
                .or_default() += 1;
        }
    }

    /// Removes the index entries of a task's previous state.
    fn index_remove(batch: &mut sled::Batch, counts: &mut CounterDeltas, record: &TaskRecord) {
        let (owner, task) = (&record.owner, &record.task);
        let order = keys::order(task.status.timestamp, &task.id);
        let state = task.status.state.number();
        batch.remove([keys::by_time_prefix(owner), order.clone()].concat());
        batch.remove([keys::by_state_prefix(owner, state), order.clone()].concat());
        batch.remove([keys::by_context_prefix(owner, &task.context_id), order].concat());
        batch.remove(keys::active(&task.id));
        if task.status.state.is_interrupted() {
            batch.remove(keys::waiting(&task.id));
        }
        *counts
            .entry(keys::counter(owner, &format!("s{state}")))
            .or_default() -= 1;
    }

    /// Writes counter changes; runs under the write lock, so read-modify-write is safe.
    fn apply_counts(
        &self,
        batch: &mut sled::Batch,
        counts: CounterDeltas,
    ) -> Result<(), LedgerError> {
        for (key, delta) in counts {
            if delta != 0 {
                let next = (self.read_counter(&key)? as i64 + delta).max(0) as u64;
                batch.insert(key, &next.to_be_bytes());
            }
        }
        Ok(())
    }

    /// Ids of tasks an agent was working on (SUBMITTED or WORKING), e.g. when
    /// the gateway stopped; interrupted and terminal tasks are not listed.
    pub fn active_task_ids(&self) -> Result<Vec<String>, LedgerError> {
        self.task_ids_under(&keys::active(""))
    }

    /// Ids of the tasks waiting for input (INPUT_REQUIRED, AUTH_REQUIRED).
    pub fn waiting_task_ids(&self) -> Result<Vec<String>, LedgerError> {
        self.task_ids_under(&keys::waiting(""))
    }

    /// The task ids of a set keyed `prefix` + task id.
    fn task_ids_under(&self, prefix: &[u8]) -> Result<Vec<String>, LedgerError> {
        self.tree
            .scan_prefix(prefix)
            .keys()
            .map(|key| Ok(String::from_utf8_lossy(&key?[prefix.len()..]).into_owned()))
            .collect()
    }

    fn read_counter(&self, key: &[u8]) -> Result<u64, LedgerError> {
        Ok(self
            .tree
            .get(key)?
            .and_then(|v| v.as_ref().try_into().ok().map(u64::from_be_bytes))
            .unwrap_or(0))
    }

    /// The events of a task after `seq`, in order.
    pub fn events_after(&self, task_id: &str, seq: u64) -> Result<Vec<LedgerEvent>, LedgerError> {
        let start = keys::event(task_id, seq + 1);
        let prefix = keys::events_prefix(task_id);
        let mut events = Vec::new();
        for entry in self.tree.range(start..) {
            let (key, value) = entry?;
            if !key.starts_with(&prefix) {
                break;
            }
            let seq_bytes: [u8; 8] = key[prefix.len()..].try_into().unwrap_or([0; 8]);
            events.push(LedgerEvent {
                task_id: task_id.to_string(),
                seq: u64::from_be_bytes(seq_bytes),
                event: serde_json::from_slice(&value)?,
            });
        }
        Ok(events)
    }

    /// One page of an owner's tasks, newest status first.
    pub fn list(&self, owner: &str, query: &ListQuery) -> Result<ListPage, LedgerError> {
        let plan = IndexPlan::new(owner, query);
        let start = match &query.page_token {
            Some(cursor) => {
                let mut key = [plan.prefix.as_slice(), cursor.as_slice()].concat();
                key.push(0); // exclusive: the first key after the cursor
                key
            }
            None => plan.prefix.clone(),
        };
        let mut page = ListPage::default();
        let mut last_order: Option<Vec<u8>> = None;
        for entry in self.tree.range(start..) {
            let (key, _) = entry?;
            let Some(suffix) = key.strip_prefix(plan.prefix.as_slice()) else {
                break;
            };
            let record = match plan.check(self, suffix)? {
                Verdict::Stop => break,
                Verdict::Skip => continue,
                Verdict::Match(Some(record)) => *record,
                Verdict::Match(None) => {
                    match keys::parse_order(suffix).and_then(|(_, id)| self.get(id).transpose()) {
                        Some(record) => record?,
                        None => continue,
                    }
                }
            };
            if page.records.len() == query.page_size {
                // One more match exists: the page has a successor.
                page.next_page_token =
                    URL_SAFE_NO_PAD.encode(last_order.take().unwrap_or_default());
                break;
            }
            last_order = Some(suffix.to_vec());
            page.records.push(record);
        }
        page.total_size = self.count(owner, query, &plan)?;
        Ok(page)
    }

    /// How many of an owner's tasks match the filters (ignoring the cursor):
    /// from a counter when one exists for the filters, else by a scan.
    fn count(
        &self,
        owner: &str,
        query: &ListQuery,
        plan: &IndexPlan,
    ) -> Result<usize, LedgerError> {
        let counter = match (&query.context_id, query.state, query.status_after) {
            (None, None, None) => Some("all".to_string()),
            (None, Some(state), None) => Some(format!("s{}", state.number())),
            (Some(context), None, None) => Some(format!("c{context}")),
            _ => None,
        };
        if let Some(name) = counter {
            return Ok(self.read_counter(&keys::counter(owner, &name))? as usize);
        }
        let mut total = 0;
        for entry in self.tree.scan_prefix(&plan.prefix) {
            let (key, _) = entry?;
            match plan.check(self, &key[plan.prefix.len()..])? {
                Verdict::Stop => break,
                Verdict::Skip => {}
                Verdict::Match(_) => total += 1,
            }
        }
        Ok(total)
    }

    /// Stores a push config durably (replacing one with the same id).
    pub async fn put_push_config(
        &self,
        config: &TaskPushNotificationConfig,
    ) -> Result<(), LedgerError> {
        let key = keys::push_config(&config.task_id, &config.id);
        let ticket = {
            let _guard = self.write_lock.lock().expect("ledger lock");
            self.tree.insert(key, serde_json::to_vec(config)?)?;
            self.flusher.note_write(Vec::new())
        };
        self.flusher.wait_durable(ticket).await;
        Ok(())
    }

    /// Reads one push config.
    pub fn get_push_config(
        &self,
        task_id: &str,
        config_id: &str,
    ) -> Result<Option<TaskPushNotificationConfig>, LedgerError> {
        match self.tree.get(keys::push_config(task_id, config_id))? {
            Some(bytes) => Ok(Some(serde_json::from_slice(&bytes)?)),
            None => Ok(None),
        }
    }

    /// Every push config of a task, by id.
    pub fn push_configs(
        &self,
        task_id: &str,
    ) -> Result<Vec<TaskPushNotificationConfig>, LedgerError> {
        self.tree
            .scan_prefix(keys::push_prefix(task_id))
            .map(|entry| Ok(serde_json::from_slice(&entry?.1)?))
            .collect()
    }

    /// Deletes a push config durably; deleting a missing one is not an error.
    pub async fn delete_push_config(
        &self,
        task_id: &str,
        config_id: &str,
    ) -> Result<(), LedgerError> {
        let ticket = {
            let _guard = self.write_lock.lock().expect("ledger lock");
            self.tree.remove(keys::push_config(task_id, config_id))?;
            self.flusher.note_write(Vec::new())
        };
        self.flusher.wait_durable(ticket).await;
        Ok(())
    }

    /// Claims an idempotency key for a send. Returns the earlier record when
    /// the key was used before, or `None` when this send now owns the key.
    pub async fn claim_idempotency(
        &self,
        owner: &str,
        key: &str,
        record: &IdempotencyRecord,
    ) -> Result<Option<IdempotencyRecord>, LedgerError> {
        let db_key = keys::idempotency(owner, key);
        let ticket = {
            let _guard = self.write_lock.lock().expect("ledger lock");
            if let Some(existing) = self.tree.get(&db_key)? {
                return Ok(Some(serde_json::from_slice(&existing)?));
            }
            self.tree.insert(db_key, serde_json::to_vec(record)?)?;
            self.flusher.note_write(Vec::new())
        };
        self.flusher.wait_durable(ticket).await;
        Ok(None)
    }

    /// Stores a registered agent durably (any JSON-serializable record).
    pub async fn put_agent<T: Serialize>(
        &self,
        agent_id: &str,
        record: &T,
    ) -> Result<(), LedgerError> {
        let ticket = {
            let _guard = self.write_lock.lock().expect("ledger lock");
            self.tree
                .insert(keys::agent(agent_id), serde_json::to_vec(record)?)?;
            self.flusher.note_write(Vec::new())
        };
        self.flusher.wait_durable(ticket).await;
        Ok(())
    }

    /// Deletes a registered agent durably.
    pub async fn delete_agent(&self, agent_id: &str) -> Result<(), LedgerError> {
        let ticket = {
            let _guard = self.write_lock.lock().expect("ledger lock");
            self.tree.remove(keys::agent(agent_id))?;
            self.flusher.note_write(Vec::new())
        };
        self.flusher.wait_durable(ticket).await;
        Ok(())
    }

    /// The ids of a task's child tasks (handoffs it started).
    pub fn children(&self, parent_task_id: &str) -> Result<Vec<String>, LedgerError> {
        let prefix = keys::child(parent_task_id, "");
        self.tree
            .scan_prefix(&prefix)
            .keys()
            .map(|key| Ok(String::from_utf8_lossy(&key?[prefix.len()..]).into_owned()))
            .collect()
    }

    /// Every registered agent, by id.
    pub fn agents<T: serde::de::DeserializeOwned>(&self) -> Result<Vec<T>, LedgerError> {
        self.tree
            .scan_prefix(keys::agent(""))
            .values()
            .map(|value| Ok(serde_json::from_slice(&value?)?))
            .collect()
    }

    /// Forgets an idempotency key whose send created nothing.
    pub async fn release_idempotency(&self, owner: &str, key: &str) -> Result<(), LedgerError> {
        let ticket = {
            let _guard = self.write_lock.lock().expect("ledger lock");
            self.tree.remove(keys::idempotency(owner, key))?;
            self.flusher.note_write(Vec::new())
        };
        self.flusher.wait_durable(ticket).await;
        Ok(())
    }

    /// Reads an idempotency record without claiming it.
    pub fn claim_idempotency_peek(
        &self,
        owner: &str,
        key: &str,
    ) -> Result<Option<IdempotencyRecord>, LedgerError> {
        match self.tree.get(keys::idempotency(owner, key))? {
            Some(bytes) => Ok(Some(serde_json::from_slice(&bytes)?)),
            None => Ok(None),
        }
    }

    /// Records the direct reply of a send that owns an idempotency key.
    pub async fn complete_idempotency(
        &self,
        owner: &str,
        key: &str,
        record: &IdempotencyRecord,
    ) -> Result<(), LedgerError> {
        let ticket = {
            let _guard = self.write_lock.lock().expect("ledger lock");
            self.tree
                .insert(keys::idempotency(owner, key), serde_json::to_vec(record)?)?;
            self.flusher.note_write(Vec::new())
        };
        self.flusher.wait_durable(ticket).await;
        Ok(())
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.flusher.stop();
    }
}
