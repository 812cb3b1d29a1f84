//! The task ledger: every gateway task, its event log, the ListTasks indexes,
//! push configs and idempotency records, in one sled database.
//!
//! Durability rule: a write returns only after the group-commit flusher has
//! made its frame in the write-ahead log durable ([`wal`]), and its events
//! reach watchers only after that. Writes are serialized by one in-process
//! lock (held for the in-memory work, never across the sync), which keeps
//! event order exact. The [`applier`] moves writes into sled in the
//! background; reads see them in its overlay until then.

pub mod append;
pub mod applier;
pub mod durable;
pub mod failing;
pub mod flusher;
pub mod hub;
pub mod keys;
pub mod record_file;
pub mod wal;

use crate::lifecycle::{self, TransitionError};
use crate::protocol::wire::ProtoEnum as _;
use crate::protocol::{StreamResponse, Task, TaskJson, TaskPushNotificationConfig, TaskState};
use applier::{Applier, PendingSet, read_counter, storage_io};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use flusher::Flusher;
use hub::{EventHub, LedgerEvent};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Ledger failures.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// No such task.
    #[error("task {0} not found")]
    NotFound(String),
    /// The lifecycle refused an event.
    #[error(transparent)]
    Transition(#[from] TransitionError),
    /// sled failed.
    #[error("storage: {0}")]
    Storage(#[from] sled::Error),
    /// A stored value did not decode.
    #[error("corrupt record: {0}")]
    Corrupt(#[from] serde_json::Error),
    /// A write would have made the task's record longer than the caller
    /// allows ([`Ledger::update_within`]); nothing was written.
    #[error("the task's record would be {bytes} bytes, more than the {limit} a task may hold")]
    RecordTooLarge {
        /// The record's length with the write.
        bytes: usize,
        /// The longest record allowed.
        limit: usize,
    },
    /// A write would have made the task's event log longer than the caller
    /// allows ([`Ledger::update_within`]); nothing was written.
    #[error("the task would hold {events} events, more than the {limit} a task may hold")]
    TooManyEvents {
        /// The task's events with the write.
        events: u64,
        /// The most events allowed.
        limit: u64,
    },
    /// A compressed record bucket failed its checksum or did not decompress.
    #[error("corrupt record bucket {0}")]
    CorruptBucket(String),
    /// The ledger was written in a format this build does not read.
    #[error("{0}")]
    Format(String),
    /// The ledger cannot take work now: its log cannot make writes
    /// durable and a read would have to wait for one, or writes cannot be
    /// applied to sled and a listing would have to apply them first.
    #[error("{0}")]
    Unavailable(String),
}

/// A gateway task as stored: the A2A task plus what the gateway knows of it.
/// It is written through `RecordJson`, the one definition of its JSON.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskRecord {
    /// The task as clients see it.
    pub task: Task,
    /// The principal that created it.
    pub owner: String,
    /// The agent currently responsible.
    pub agent: String,
    /// The task's ids at its agent, for agents that keep their own.
    #[serde(default)]
    pub upstream: Option<crate::agents::UpstreamRef>,
    /// Bumped on every write.
    pub version: u64,
    /// Sequence number of the last event in the task's log.
    pub last_seq: u64,
    /// When the gateway created the task.
    #[serde(with = "crate::protocol::wire::record_timestamp")]
    pub created_at: DateTime<Utc>,
    /// The gateway task this one is a child of (a handoff's `parentTaskId`).
    #[serde(default)]
    pub parent_task_id: Option<String>,
    /// The JSON Schema the result must satisfy (a handoff's `returnSchema`).
    #[serde(default)]
    pub return_schema: Option<serde_json::Value>,
    /// Whether `return_schema` is the output schema the holder declared for
    /// the skill it was chosen by (the payload named none): a reroute then
    /// takes the alternative's.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub return_schema_by_skill: bool,
    /// Every agent that has held this task, in order: the task's own part of
    /// the handoff graph, for `baton trace` and the metrics.
    #[serde(default)]
    pub hops: Vec<HopRecord>,
    /// Where a transfer came from, while its target works on the task.
    #[serde(default)]
    pub transfer: Option<TransferSource>,
    /// The first of the artifacts `return_schema` checks: the current
    /// holder's own, since the handoff that made it the holder. Unset in
    /// records written before it was kept: see [`Self::schema_from`].
    #[serde(default)]
    pub return_schema_from: Option<usize>,
    /// The digests of the artifacts before `return_schema_from`, noted
    /// then: one the holder changed since is its own too
    /// ([`crate::handoff::artifacts::made_since`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub return_schema_digests: Vec<u64>,
    /// The returnSchemas of holders that handed the task on for good since
    /// the last handoff that asks for its result back: what ends or
    /// returns the task is their result too, so each still binds it.
    #[serde(default)]
    pub handed_on_schemas: Vec<SchemaBinding>,
    /// See [`append::LoggedLen`].
    #[serde(skip)]
    pub logged_len: append::LoggedLen,
}

/// A returnSchema and the first of the task's artifacts it checks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SchemaBinding {
    /// The JSON Schema.
    pub schema: serde_json::Value,
    /// The first artifact it checks.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub from: usize,
    /// The digests of the artifacts before `from`, noted then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub digests: Vec<u64>,
}

/// Where a holder's own artifacts begin: from `from` on, and earlier ones
/// whose digest is no longer the one noted (see
/// [`crate::handoff::artifacts::made_since`]).
#[derive(Clone, Copy, Debug)]
pub struct ArtifactMark<'a> {
    /// The artifacts before the handoff.
    pub from: usize,
    /// Their digests then.
    pub digests: &'a [u64],
}

impl ArtifactMark<'_> {
    /// The artifacts of `artifacts` made since the mark, each with its index.
    pub fn made_since<'a>(
        &self,
        artifacts: &'a [crate::protocol::Artifact],
    ) -> Vec<(usize, &'a crate::protocol::Artifact)> {
        crate::handoff::artifacts::made_since(artifacts, self.from, self.digests)
    }
}

impl TaskRecord {
    /// The first of the artifacts `return_schema` checks; a record written
    /// before that was kept checks from its transfer's start, as then.
    pub fn schema_from(&self) -> usize {
        self.return_schema_from
            .unwrap_or_else(|| self.transfer.as_ref().map_or(0, |t| t.artifacts_before))
    }

    /// Where the artifacts `return_schema` checks begin: [`Self::schema_from`]
    /// and the digests noted with it.
    pub fn schema_mark(&self) -> ArtifactMark<'_> {
        let digests = match (self.return_schema_from, &self.transfer) {
            (None, Some(transfer)) => &transfer.before_digests,
            _ => &self.return_schema_digests,
        };
        ArtifactMark {
            from: self.schema_from(),
            digests,
        }
    }

    /// Every returnSchema the holder's result must meet, with where the
    /// artifacts each checks begin: its own handoff's, then those of
    /// holders before it that handed on for good.
    pub fn result_schemas(&self) -> impl Iterator<Item = (&serde_json::Value, ArtifactMark<'_>)> {
        let own = self.return_schema.as_ref().map(|s| (s, self.schema_mark()));
        let handed_on = self.handed_on_schemas.iter().map(|b| {
            let mark = ArtifactMark {
                from: b.from,
                digests: &b.digests,
            };
            (&b.schema, mark)
        });
        own.into_iter().chain(handed_on)
    }

    /// Whether `other` names the same agent, and the same task at it, as
    /// responsible for the task.
    pub fn same_holder(&self, other: &TaskRecord) -> bool {
        self.agent == other.agent && self.upstream == other.upstream
    }
}

impl Serialize for TaskRecord {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        RecordJson::new(self, &self.task).serialize(serializer)
    }
}

/// A record as written: the one definition of its JSON. `T` is the task,
/// as the struct or as its JSON encoded already (a write encodes the task
/// once, for the record and for the reply).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct RecordJson<'a, T> {
    task: T,
    owner: &'a str,
    agent: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    upstream: Option<&'a crate::agents::UpstreamRef>,
    version: u64,
    last_seq: u64,
    #[serde(with = "crate::protocol::wire::record_timestamp")]
    created_at: DateTime<Utc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent_task_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    return_schema: Option<&'a serde_json::Value>,
    #[serde(skip_serializing_if = "<[HopRecord]>::is_empty")]
    hops: &'a [HopRecord],
    #[serde(skip_serializing_if = "Option::is_none")]
    transfer: Option<&'a TransferSource>,
    #[serde(skip_serializing_if = "Option::is_none")]
    return_schema_from: Option<usize>,
    #[serde(skip_serializing_if = "<[u64]>::is_empty")]
    return_schema_digests: &'a [u64],
    #[serde(skip_serializing_if = "is_zero")]
    return_schema_by_skill: bool,
    #[serde(skip_serializing_if = "<[SchemaBinding]>::is_empty")]
    handed_on_schemas: &'a [SchemaBinding],
}

impl<'a, T> RecordJson<'a, T> {
    fn new(record: &'a TaskRecord, task: T) -> Self {
        // Taken apart whole, so a field added to the record must be added here.
        let TaskRecord {
            task: _,
            owner,
            agent,
            upstream,
            version,
            last_seq,
            created_at,
            parent_task_id,
            return_schema,
            hops,
            transfer,
            return_schema_from,
            return_schema_digests,
            return_schema_by_skill,
            handed_on_schemas,
            logged_len: _,
        } = record;
        Self {
            task,
            owner,
            agent,
            upstream: upstream.as_ref(),
            version: *version,
            last_seq: *last_seq,
            created_at: *created_at,
            parent_task_id: parent_task_id.as_deref(),
            return_schema: return_schema.as_ref(),
            hops,
            transfer: transfer.as_ref(),
            return_schema_from: *return_schema_from,
            return_schema_digests,
            return_schema_by_skill: *return_schema_by_skill,
            handed_on_schemas,
        }
    }
}

/// A task read decoded: its record, and its task's JSON when the write
/// that made this very record encoded it and the overlay still holds both.
#[derive(Debug)]
pub struct ReadTask {
    /// The record.
    pub record: Arc<TaskRecord>,
    /// `record.task` as JSON, written by the ledger's write.
    pub task_json: Option<Arc<RawValue>>,
    /// The log ticket of the write that made the record. A read sees a
    /// write before it is durable; no one may be shown it before
    /// ([`Ledger::until_durable`]). 0 for a record known to be durable.
    pub ticket: u64,
}

/// A task read for a reply (`GetTask`, `ListTasks`): a record in sled is
/// not decoded, as the reply is shaped from its task's JSON.
#[derive(Debug)]
pub enum ReplyTask {
    /// A write not yet in sled, or a record at hand.
    Read(ReadTask),
    /// A record as sled holds it.
    Stored(StoredRecord),
}

impl ReplyTask {
    /// The principal the task belongs to.
    pub fn owner(&self) -> Result<Cow<'_, str>, LedgerError> {
        Ok(match self {
            Self::Read(read) => Cow::Borrowed(&read.record.owner),
            Self::Stored(stored) => stored.head()?.owner,
        })
    }

    /// The state the task is in.
    fn state(&self) -> Result<TaskState, LedgerError> {
        Ok(match self {
            Self::Read(read) => read.record.task.status.state,
            Self::Stored(stored) => stored.head()?.task.status.state,
        })
    }

    /// How far the task's events go, as a push config's mark would say
    /// it: its last event, and whether it has ended.
    fn events_through(&self) -> Result<PushMark, LedgerError> {
        let (through, state) = match self {
            Self::Read(read) => (read.record.last_seq, read.record.task.status.state),
            Self::Stored(stored) => {
                let head = stored.head()?;
                (head.last_seq, head.task.status.state)
            }
        };
        Ok(PushMark {
            through,
            task_ended: state.is_terminal(),
        })
    }

    /// The log ticket that makes this read durable (see [`ReadTask::ticket`]).
    pub fn ticket(&self) -> u64 {
        match self {
            Self::Read(read) => read.ticket,
            Self::Stored(_) => 0,
        }
    }

    /// The whole record, decoded.
    pub fn into_record(self) -> Result<Arc<TaskRecord>, LedgerError> {
        match self {
            Self::Read(read) => Ok(read.record),
            Self::Stored(stored) => {
                let mut record: TaskRecord = decode_stored(&stored.bytes)?;
                let total = stored.bytes.len();
                record.logged_len = append::LoggedLen { total, body: None };
                Ok(Arc::new(record))
            }
        }
    }
}

/// A record as sled holds it, read without decoding.
#[derive(Debug)]
pub struct StoredRecord {
    bytes: sled::IVec,
}

/// What a reply checks of a stored record before shaping it: its owner and
/// its task's state.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StoredHead<'a> {
    #[serde(borrow)]
    owner: Cow<'a, str>,
    task: StoredTaskHead,
    #[serde(default)]
    last_seq: u64,
}

#[derive(Deserialize)]
struct StoredTaskHead {
    #[serde(default)]
    status: StoredStatusHead,
}

#[derive(Default, Deserialize)]
struct StoredStatusHead {
    #[serde(default)]
    state: TaskState,
}

impl StoredRecord {
    /// The record's owner and state, the rest skipped.
    fn head(&self) -> Result<StoredHead<'_>, LedgerError> {
        Ok(decode_stored(&self.bytes)?)
    }

    /// The record's task, taken apart into its fields' JSON.
    pub fn task_json(&self) -> serde_json::Result<TaskJson<'_>> {
        #[derive(Deserialize)]
        struct RecordTask<'a> {
            #[serde(borrow)]
            task: TaskJson<'a>,
        }
        Ok(decode_stored::<RecordTask>(&self.bytes)?.task)
    }
}

/// What a [`Ledger::update`] did to a task record.
#[derive(Debug)]
pub enum Change {
    /// Nothing: the record is left exactly as read, and nothing is logged.
    Unchanged,
    /// The record changed; these events (possibly none) describe it.
    Made(Vec<StreamResponse>),
}

impl From<Vec<StreamResponse>> for Change {
    fn from(events: Vec<StreamResponse>) -> Self {
        Self::Made(events)
    }
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
    #[serde(with = "crate::protocol::wire::record_timestamp")]
    pub started_at: DateTime<Utc>,
    /// When it acknowledged (its first answer).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::protocol::wire::record_timestamp::option"
    )]
    pub acked_at: Option<DateTime<Utc>>,
    /// When its turn ended.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::protocol::wire::record_timestamp::option"
    )]
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
    /// The skill a routing rule chose the agent by, which a reroute keeps
    /// to after a restart too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skill: Option<String>,
    /// A transfer's or a returned result's delivery, kept until its agent
    /// acknowledges it: the record holds its message nowhere else, and a
    /// restart makes it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undelivered: Option<Undelivered>,
    /// Where in the task's history the caller's answers to this delivery's
    /// escalations are, kept until the agent acknowledges (for a restart;
    /// history is never cut, and nothing is copied). On the hop the
    /// delivery began at, every answer since the first, each delivered
    /// after the message as first made; on the hop an answer reopened, the
    /// answers that did, where the redelivery's ladder begins.
    #[serde(
        default,
        alias = "escalationAnswer",
        deserialize_with = "one_or_many",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub escalation_answers: Vec<usize>,
}

/// A list of history positions, also as the one number a record written
/// before a hop could note several holds.
fn one_or_many<'de, D: serde::Deserializer<'de>>(from: D) -> Result<Vec<usize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(usize),
        Many(Vec<usize>),
    }
    Ok(match OneOrMany::deserialize(from)? {
        OneOrMany::One(at) => vec![at],
        OneOrMany::Many(all) => all,
    })
}

/// A delivery its agent has not acknowledged yet.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Undelivered {
    /// The message, its messageId included, as the agent is sent it.
    pub message: crate::protocol::Message,
    /// The skill the agent was chosen by, which a reroute keeps to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skill: Option<String>,
    /// Where at the agent a returned result goes: the task its source left
    /// waiting, or (that task over) only the source's context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<crate::agents::UpstreamRef>,
}

/// Whether a count is zero, to leave it out of a record.
fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
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
    /// The digests of those artifacts, noted then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub before_digests: Vec<u64>,
    /// Earlier sources on this task still waiting for a result, outermost
    /// first (each with none of its own): a target that hands the task on
    /// again does not drop its own source.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting: Vec<TransferSource>,
    /// For a source in `waiting`, and for a transfer open again after an
    /// inner result returned: its handoff's returnSchema, checked on all
    /// that goes back to its source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_schema: Option<serde_json::Value>,
    /// The returnSchema that bound the source's own work when it handed
    /// on (a handoff's to it), the record's again when the result returns
    /// to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_schema: Option<serde_json::Value>,
    /// The first artifact `source_schema` checks (the source's own work).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub source_schema_from: usize,
    /// The digests noted with `source_schema_from`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_schema_digests: Vec<u64>,
    /// The task's deadline when the source handed it on, its own again
    /// when the result returns to it: a target's shorter taskTimeout
    /// binds that target's work only.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::protocol::wire::record_timestamp::option"
    )]
    pub deadline_before: Option<DateTime<Utc>>,
    /// The task's hop limit when the source handed it on, its own again
    /// when the result returns to it: a target's lower maxHops binds that
    /// target's work only. `None` in records written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_hops_before: Option<u32>,
    /// The record's `handed_on_schemas` when the source handed on for the
    /// result, its own again when the result returns to it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_handed_on: Vec<SchemaBinding>,
    /// The task ended short of a result while the source waited for it:
    /// no result returns to it any more ([`Self::release_waiting`]).
    #[serde(default, skip_serializing_if = "crate::protocol::wire::is_false")]
    pub released: bool,
}

impl TransferSource {
    /// The record of a new transfer away from the task's holder, which
    /// takes over what `earlier` (the transfer to that holder, whose
    /// returnSchema was `earlier_schema`) still owes.
    pub fn after(
        mut self,
        earlier: Option<TransferSource>,
        earlier_schema: Option<serde_json::Value>,
    ) -> Self {
        self.waiting = match earlier {
            Some(mut earlier) => {
                let mut waiting = std::mem::take(&mut earlier.waiting);
                if earlier.return_to_parent {
                    earlier.return_schema = earlier_schema;
                    waiting.push(earlier);
                }
                waiting
            }
            None => Vec::new(),
        };
        self
    }

    /// The returnSchema the result must satisfy on its way back, where it
    /// is not the record's own: a waiting source's, or this transfer's once
    /// it is open again after an inner result returned.
    pub fn returned_schema(&self) -> Option<&serde_json::Value> {
        self.result_goes_to()?.return_schema.as_ref()
    }

    /// The source the holder's result goes to: this one if it asked for
    /// it, else the nearest earlier one waiting.
    pub fn result_goes_to(&self) -> Option<&TransferSource> {
        if self.return_to_parent {
            Some(self)
        } else {
            self.waiting.last()
        }
    }

    /// What is still owed once the result went to [`Self::result_goes_to`]:
    /// the next source out, holding the rest.
    pub fn after_return(&self) -> Option<TransferSource> {
        let mut waiting = self.waiting.clone();
        if !self.return_to_parent {
            waiting.pop();
        }
        let mut next = waiting.pop()?;
        next.waiting = waiting;
        Some(next)
    }

    /// Marks every source still waiting for a result as released, once:
    /// the task ended short of it. `None` when none was newly marked; else
    /// those whose own task was still open (their agents and tasks),
    /// nearest first, to be sent CancelTask; those tasks are noted canceled.
    pub fn release_waiting(&mut self) -> Option<Vec<(String, Option<crate::agents::UpstreamRef>)>> {
        let mut marked = false;
        let mut to_cancel = Vec::new();
        let mut release = |source: &mut TransferSource| {
            if source.released {
                return;
            }
            source.released = true;
            marked = true;
            if !source.state.is_terminal() {
                source.state = TaskState::Canceled;
                to_cancel.push((source.agent.clone(), source.upstream.clone()));
            }
        };
        if self.return_to_parent {
            release(&mut *self);
        }
        for source in self.waiting.iter_mut().rev() {
            release(source);
        }
        marked.then_some(to_cancel)
    }
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
    /// The [`Ledger::instance`] that claimed the key (0 in records older
    /// than the field): a claim of an earlier one that neither created its
    /// task nor got a message never will.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub claimed_by: u64,
    /// Continuing a task: its history's length when the key was claimed,
    /// so only a message added since fills the claim (a messageId may be
    /// reused). Absent in older records: the whole history counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_from: Option<usize>,
    /// Which of `claimed_by`'s claims this is (0: unnumbered, as in older
    /// records): a repeat in the same run takes over a claim whose send
    /// ended without filling it ([`crate::gateway::Gateway`]'s held claims).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub claim_number: u64,
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
    pub records: Vec<ReplyTask>,
    /// Cursor of the next page; empty on the last page.
    pub next_page_token: String,
    /// How many tasks match in all.
    pub total_size: usize,
}

/// Events a replay returns at most.
const REPLAY_PAGE_EVENTS: usize = 256;

/// Stored bytes of events after which a replay returns what it has.
const REPLAY_PAGE_BYTES: usize = 1024 * 1024;

/// A page of a task's events, read back for a stream that fell behind.
#[derive(Debug, Default)]
pub struct ReplayPage {
    /// The events, in order.
    pub events: Vec<LedgerEvent>,
    /// Whether more events follow: the page filled before the log's end.
    pub more: bool,
}

/// How a ListTasks query is served: the narrowest index ranges, and what
/// must still be checked for each of their entries.
struct IndexPlan {
    /// Ranges sorted newest first; several are merged. All tasks are the
    /// by-state ranges of every state, which spares each task a key of an
    /// all-tasks index (and sled's page table the memory of it).
    prefixes: Vec<Vec<u8>>,
    /// The order suffix of the task a queried context was minted for,
    /// which the by-context index leaves out.
    minted_first: Option<Vec<u8>>,
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
    /// Matches; the task, if it had to be read.
    Match(Option<ReplyTask>),
}

impl IndexPlan {
    fn new(owner: &str, query: &ListQuery) -> Self {
        let (prefixes, check_state) = match (&query.context_id, query.state) {
            (Some(context), state) => (vec![keys::by_context_prefix(owner, context)], state),
            (None, Some(state)) => (vec![keys::by_state_prefix(owner, state.number())], None),
            (None, None) => (
                TaskState::VALUES
                    .iter()
                    .map(|&(_, _, number)| keys::by_state_prefix(owner, number as u8))
                    .collect(),
                None,
            ),
        };
        Self {
            prefixes,
            minted_first: None,
            check_state,
            after_millis: query.status_after.map(after_millis),
        }
    }

    /// The order suffixes of the plan's entries after `cursor` (all of them
    /// without one), newest status first.
    fn entries<'a>(
        &'a self,
        tree: &sled::Tree,
        cursor: Option<&[u8]>,
    ) -> Result<MergedEntries<'a>, LedgerError> {
        let mut ranges = Vec::with_capacity(self.prefixes.len() + 1);
        for prefix in &self.prefixes {
            let (start, bucket) = match cursor {
                Some(cursor) => {
                    // The first key after the cursor, exclusive; the
                    // cursor's bucket sorts before it, and is read from
                    // the cursor's id on.
                    let mut start = [prefix.as_slice(), cursor].concat();
                    start.push(0);
                    let bucketed = keys::by_state_parts(prefix)
                        .is_some_and(|(_, state, _)| applier::is_bucketed_state(state));
                    let bucket = match cursor.split_at_checked(keys::ORDER_TIME_LEN) {
                        Some((time, id)) if bucketed => tree
                            .get([prefix.as_slice(), time].concat())?
                            .and_then(|value| BucketReader::after(time, value, id)),
                        _ => None,
                    };
                    (start, bucket)
                }
                None => (prefix.clone(), None),
            };
            ranges.push(IndexRange {
                prefix,
                keys: Some(tree.range(start..)),
                peeked: None,
                bucket,
            });
        }
        if let Some(first) = &self.minted_first {
            ranges.push(IndexRange {
                prefix: &[],
                keys: None,
                peeked: Some((first.as_slice().into(), sled::IVec::default())),
                bucket: None,
            });
        }
        Ok(MergedEntries {
            ranges,
            next: Vec::new(),
            after: cursor.map(<[u8]>::to_vec),
        })
    }

    fn check(
        &self,
        ledger: &Ledger,
        suffix: &[u8],
        memo: &mut applier::BucketMemo,
    ) -> Result<Verdict, LedgerError> {
        let Some((millis, task_id)) = keys::parse_order(suffix) else {
            return Ok(Verdict::Skip);
        };
        if self.after_millis.is_some_and(|after| millis < after) {
            return Ok(Verdict::Stop); // sorted newest first
        }
        let Some(state) = self.check_state else {
            return Ok(Verdict::Match(None));
        };
        Ok(match ledger.read_for_reply(task_id, Some(memo))? {
            Some(task) if task.state()? == state => Verdict::Match(Some(task)),
            _ => Verdict::Skip,
        })
    }
}

/// One index range being read. Its sled keys are single entries and
/// buckets (see [`keys::bucket_ids`]); a bucket sorts just before the
/// single entries of its millisecond, so its entries are merged with those.
struct IndexRange<'a> {
    prefix: &'a [u8],
    keys: Option<sled::Iter>,
    /// The range's next sled key with its value, not yet merged.
    peeked: Option<(sled::IVec, sled::IVec)>,
    /// The bucket being read out.
    bucket: Option<BucketReader>,
}

/// The entries of one bucket, read out one at a time.
struct BucketReader {
    value: sled::IVec,
    /// The current entry: the bucket's time and the current id.
    entry: Vec<u8>,
    /// Where the id after the current one starts in `value`.
    next: usize,
}

impl BucketReader {
    /// A reader at the bucket's first entry; `None` for an empty bucket.
    fn new(time: &[u8], value: sled::IVec) -> Option<Self> {
        let mut reader = Self {
            value,
            entry: time.to_vec(),
            next: 0,
        };
        reader.advance().then_some(reader)
    }

    /// A reader at the bucket's first id after `id`; `None` if none is.
    fn after(time: &[u8], value: sled::IVec, id: &[u8]) -> Option<Self> {
        let mut reader = Self::new(time, value)?;
        while reader.id() <= id {
            if !reader.advance() {
                return None;
            }
        }
        Some(reader)
    }

    fn id(&self) -> &[u8] {
        &self.entry[keys::ORDER_TIME_LEN..]
    }

    /// Moves to the next id; false when there is none.
    fn advance(&mut self) -> bool {
        let Some((id, next)) = keys::bucket_id_at(&self.value, self.next) else {
            return false;
        };
        self.entry.truncate(keys::ORDER_TIME_LEN);
        self.entry.extend_from_slice(id);
        self.next = next;
        true
    }
}

/// Where a range's next entry is.
#[derive(Clone, Copy)]
enum NextIn {
    /// The bucket being read out.
    Bucket,
    /// The peeked sled key, a single entry.
    Key,
}

impl IndexRange<'_> {
    /// Where the range's next entry is, reading sled as far as needed to
    /// know it: at most one key past the bucket being read out.
    fn next_in(&mut self) -> Result<Option<NextIn>, LedgerError> {
        loop {
            if self.peeked.is_none()
                && let Some(keys) = &mut self.keys
            {
                match keys.next() {
                    Some(Ok((key, value))) if key.starts_with(self.prefix) => {
                        self.peeked = Some((key, value));
                    }
                    Some(Err(err)) => return Err(err.into()),
                    // This range is done.
                    _ => self.keys = None,
                }
            }
            let suffix = self
                .peeked
                .as_ref()
                .map(|(key, _)| &key[self.prefix.len()..]);
            match (&self.bucket, suffix) {
                // A later bucket's entries are all older than this one's.
                (Some(bucket), Some(suffix)) => {
                    let bucket_first =
                        keys::is_bucket_suffix(suffix) || bucket.entry.as_slice() < suffix;
                    return Ok(Some(if bucket_first {
                        NextIn::Bucket
                    } else {
                        NextIn::Key
                    }));
                }
                (Some(_), None) => return Ok(Some(NextIn::Bucket)),
                (None, Some(suffix)) if keys::is_bucket_suffix(suffix) => {
                    let time = suffix.to_vec();
                    let (_, value) = self.peeked.take().expect("peeked above");
                    self.bucket = BucketReader::new(&time, value);
                }
                (None, Some(_)) => return Ok(Some(NextIn::Key)),
                (None, None) => return Ok(None),
            }
        }
    }

    /// The entry at `next`.
    fn entry(&self, next: NextIn) -> &[u8] {
        match next {
            NextIn::Bucket => self.bucket.as_ref().map_or(&[], |b| b.entry.as_slice()),
            NextIn::Key => self
                .peeked
                .as_ref()
                .map_or(&[], |(key, _)| &key[self.prefix.len()..]),
        }
    }

    /// Takes the entry at `next`.
    fn take(&mut self, next: NextIn) -> Option<Vec<u8>> {
        match next {
            NextIn::Bucket => {
                let bucket = self.bucket.as_mut()?;
                let entry = bucket.entry.clone();
                if !bucket.advance() {
                    self.bucket = None;
                }
                Some(entry)
            }
            NextIn::Key => self
                .peeked
                .take()
                .map(|(key, _)| key[self.prefix.len()..].to_vec()),
        }
    }
}

/// Several index ranges merged by order suffix. Each range is read lazily,
/// so a first page reads about a page of entries plus one per range. An
/// entry held both in a bucket and as a key of its own (a ledger from
/// before buckets, replayed) comes once.
struct MergedEntries<'a> {
    ranges: Vec<IndexRange<'a>>,
    /// Where each range's next entry is, reused from entry to entry.
    next: Vec<Option<NextIn>>,
    /// Entries up to this one are skipped (the cursor, then the last given).
    after: Option<Vec<u8>>,
}

impl MergedEntries<'_> {
    /// The smallest next entry of all ranges.
    fn next_entry(&mut self) -> Result<Option<Vec<u8>>, LedgerError> {
        self.next.clear();
        for range in &mut self.ranges {
            self.next.push(range.next_in()?);
        }
        let smallest = self
            .ranges
            .iter()
            .zip(&self.next)
            .enumerate()
            .filter_map(|(at, (range, next))| next.map(|next| (at, range.entry(next), next)))
            .min_by(|a, b| a.1.cmp(b.1))
            .map(|(at, _, next)| (at, next));
        Ok(smallest.and_then(|(at, next)| self.ranges[at].take(next)))
    }
}

impl Iterator for MergedEntries<'_> {
    type Item = Result<Vec<u8>, LedgerError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let entry = match self.next_entry() {
                Ok(Some(entry)) => entry,
                Ok(None) => return None,
                Err(err) => return Some(Err(err)),
            };
            match &mut self.after {
                Some(after) if entry <= *after => continue,
                Some(after) => {
                    after.clear();
                    after.extend_from_slice(&entry);
                }
                None => self.after = Some(entry.clone()),
            }
            return Some(Ok(entry));
        }
    }
}

/// A timestamp in index precision (milliseconds), rounded up so that
/// "at or after" holds for the stored, millisecond-precise times.
fn after_millis(time: DateTime<Utc>) -> u64 {
    let micros = time.timestamp_micros().max(0) as u64;
    micros.div_ceil(1000)
}

/// The ledger format this build writes and reads: replies copy a stored
/// task's JSON verbatim, so a change to that JSON or to the key layout
/// needs a new format (and a conversion of older ledgers at open).
/// Format 2 may store record buckets LZ4-compressed ([`keys::seal_record_bucket`]);
/// it reads format 1's plain ones as they are. Format 3 keeps new record
/// buckets in the record file ([`record_file`]) and reads older ones from sled.
/// Format 4 may log a large record's write as what it added ([`append`]),
/// which earlier builds would take for damage in the log.
const LEDGER_FORMAT: u32 = 4;

/// The format of a ledger written before the marker existed.
const UNMARKED_FORMAT: u32 = 1;

/// Refuses a ledger of a later format rather than misreading it, and marks
/// every other one with this build's format: from now on it may hold this
/// build's writes, which an earlier build must not misread.
fn check_format(tree: &sled::Tree) -> Result<(), LedgerError> {
    check_format_as(tree, LEDGER_FORMAT, UNMARKED_FORMAT)
}

/// [`check_format`] for a build writing format `current`, where a ledger
/// without a marker is of format `unmarked`.
fn check_format_as(tree: &sled::Tree, current: u32, unmarked: u32) -> Result<(), LedgerError> {
    let marker = tree.get(keys::format())?;
    let format = match &marker {
        Some(value) => <[u8; 4]>::try_from(value.as_ref())
            .map(u32::from_be_bytes)
            .map_err(|_| {
                LedgerError::Format(format!("unreadable ledger format marker {value:?}"))
            })?,
        None if tree.is_empty() => current,
        None => unmarked,
    };
    if format > current {
        return Err(LedgerError::Format(format!(
            "ledger format {format} is later than this Baton's ({current}): \
             run the Baton that wrote it, or a later one"
        )));
    }
    if marker.as_deref() != Some(current.to_be_bytes().as_slice()) {
        tree.insert(keys::format(), &current.to_be_bytes())?;
        tree.flush()?;
    }
    Ok(())
}

/// Removes the all-tasks index that earlier ledgers kept and nothing
/// reads any more, in bounded batches. Not logged: an interrupted removal
/// simply goes on at the next open.
fn remove_retired_index(tree: &sled::Tree) -> Result<(), LedgerError> {
    loop {
        let retired = tree
            .scan_prefix(keys::retired_by_time_prefix())
            .keys()
            .take(10_000)
            .collect::<Result<Vec<_>, _>>()?;
        if retired.is_empty() {
            return Ok(());
        }
        let mut batch = sled::Batch::default();
        for key in retired {
            batch.remove(key);
        }
        tree.apply_batch(batch)?;
    }
}

/// Decodes and checks a ListTasks page token.
pub fn decode_page_token(token: &str) -> Option<Vec<u8>> {
    let bytes = URL_SAFE_NO_PAD.decode(token).ok()?;
    keys::parse_order(&bytes).map(|_| bytes.clone())
}

/// How far the notifications of one push config were handled (delivered
/// or given up): its `pd` key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PushMark {
    /// The last event handled (or, for a new config, its task's last event
    /// then: the config is owed none before).
    pub through: u64,
    /// The task had ended: nothing more is owed.
    pub task_ended: bool,
}

impl PushMark {
    fn encode(self) -> Vec<u8> {
        let mut bytes = self.through.to_be_bytes().to_vec();
        bytes.push(u8::from(self.task_ended));
        bytes
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let (through, ended) = bytes.split_first_chunk::<8>()?;
        Some(Self {
            through: u64::from_be_bytes(*through),
            task_ended: ended.first().is_some_and(|&b| b == 1),
        })
    }

    /// This mark moved on by `handled`, never back.
    fn joined(self, handled: Self) -> Self {
        Self {
            through: self.through.max(handled.through),
            task_ended: self.task_ended || handled.task_ended,
        }
    }
}

/// Raw keys and their values, in key order.
type RawEntries = std::collections::BTreeMap<Vec<u8>, Vec<u8>>;

/// The durable task ledger.
pub struct Ledger {
    tree: sled::Tree,
    // std Mutex: serializes writers for read-modify-write and keeps log order;
    // guards the frame scratch buffer; never held across .await.
    write_lock: Mutex<Vec<u8>>,
    flusher: Arc<Flusher>,
    applier: Arc<Applier>,
    hub: Arc<EventHub>,
    push_configs_stored: Arc<AtomicU64>,
    /// Told of each state change an update logs.
    transitions: OnceLock<TransitionObserver>,
    /// Names this opening of the ledger (random, never 0).
    instance: u64,
}

/// A task [`Ledger::create_within`] wrote.
#[derive(Debug)]
pub struct CreatedTask {
    /// The task as written.
    pub record: Arc<TaskRecord>,
    /// The limit its events would have passed: it was created from its
    /// first event alone.
    pub cut: Option<TaskLimit>,
}

/// The most a task may hold, checked on the writes of content (an agent's
/// report, a client's message). Every write rewrites the task's whole
/// record, so each bounds what one task costs every later write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskLimits {
    /// Most events in its log (`last_seq`).
    pub max_events: u64,
    /// Longest its record, as encoded for the log.
    pub max_bytes: usize,
}

impl TaskLimits {
    /// No bound: for writes Baton makes itself.
    pub const NONE: Self = Self {
        max_events: u64::MAX,
        max_bytes: usize::MAX,
    };
}

/// Which of [`TaskLimits`] a write would have passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskLimit {
    /// `max_events`.
    Events,
    /// `max_bytes`.
    Bytes,
}

impl LedgerError {
    /// The limit this error says a write would have passed.
    pub fn passed_limit(&self) -> Option<TaskLimit> {
        match self {
            Self::TooManyEvents { .. } => Some(TaskLimit::Events),
            Self::RecordTooLarge { .. } => Some(TaskLimit::Bytes),
            _ => None,
        }
    }

    /// Whether a stored value was read but did not decode: about that one
    /// value, not about the ledger.
    pub fn is_corrupt(&self) -> bool {
        matches!(self, Self::Corrupt(_) | Self::CorruptBucket(_))
    }
}

/// Told of a task's state change once the update that made it is logged
/// (not yet durable: a write the log then fails to sync is counted too):
/// the state left, the state entered, and how long the task was in the
/// first (since its status was last set, or since it was created). Called
/// under the ledger's write lock, so it must be quick.
pub type TransitionObserver = Box<dyn Fn(TaskState, TaskState, std::time::Duration) + Send + Sync>;

/// Polls `found` every 5 ms until it finds something, for at most 5 s
/// (then the test fails, saying `what` it waited for).
#[cfg(test)]
pub(crate) async fn until<T>(what: &str, mut found: impl FnMut() -> Option<T>) -> T {
    let polled = async {
        loop {
            if let Some(found) = found() {
                return found;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), polled)
        .await
        .unwrap_or_else(|_| panic!("waited 5 s: {what}"))
}

/// Opens the sled database in `dir`. sled 0.34 writes a snapshot to
/// `snap.<lsn>.generating` and renames it once synced, but at open it takes
/// the highest-named `snap.` file, that one included: a snapshot write cut
/// short (a full disk) leaves a file that every later open refuses as
/// corrupt. Such a file is never a finished snapshot, so when sled refuses
/// one, it is removed and the open tried again. (Not before: a running
/// Baton on the same directory may be writing one; sled's lock refuses the
/// second process first.)
fn open_sled(dir: &Path) -> Result<sled::Db, LedgerError> {
    let open = || {
        sled::Config::new()
            .path(dir)
            .cache_capacity(64 * 1024 * 1024)
            // The write-ahead log makes writes durable; sled is flushed at checkpoints.
            .flush_every_ms(None)
            .open()
    };
    match open() {
        Err(sled::Error::Corruption { .. }) if remove_unfinished_snapshots(dir)? > 0 => Ok(open()?),
        opened => Ok(opened?),
    }
}

/// Removes sled's unfinished snapshot files from `dir`; returns how many.
fn remove_unfinished_snapshots(dir: &Path) -> Result<usize, LedgerError> {
    let mut removed = 0;
    for entry in std::fs::read_dir(dir).map_err(storage_io)? {
        let path = entry.map_err(storage_io)?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with("snap.") && name.ends_with(".generating") {
            tracing::warn!(path = %path.display(), "removing an unfinished sled snapshot");
            std::fs::remove_file(&path).map_err(storage_io)?;
            removed += 1;
        }
    }
    Ok(removed)
}

impl Ledger {
    /// Opens (or creates) the ledger in `dir`, applying whatever the log
    /// holds from a process that stopped without closing it.
    pub fn open(dir: &Path) -> Result<Self, LedgerError> {
        Self::open_with_applier(dir, ApplierStart::Running)
    }

    /// Holds the log's syncs until the guard is dropped (see
    /// [`Flusher::hold`]).
    #[cfg(test)]
    pub(crate) fn hold_log(&self) -> flusher::LogHold {
        self.flusher.hold()
    }

    /// Makes the log's appends fail with `kind` until the guard is dropped
    /// (see [`Flusher::fail_appends`]).
    #[cfg(test)]
    pub(crate) fn fail_log(&self, kind: std::io::ErrorKind) -> failing::FaultGuard {
        self.flusher.fail_appends(kind)
    }

    /// Makes applications to sled and checkpoints fail with `kind` until
    /// the guard is dropped (see [`Applier::fail`]).
    #[cfg(test)]
    pub(crate) fn fail_sled(&self, kind: std::io::ErrorKind) -> failing::FaultGuard {
        self.applier.fail(kind)
    }

    /// Overwrites the record sled holds for the active task `task_id` with
    /// bytes that do not decode, as a damaged disk or a bug might.
    #[cfg(test)]
    pub(crate) fn damage_record(&self, task_id: &str) {
        drop(self.applier.applied().expect("applied"));
        let key = keys::task(task_id);
        assert!(
            self.tree.get(&key).unwrap().is_some(),
            "an active task's record"
        );
        self.tree.insert(key, &b"{not a record"[..]).unwrap();
    }

    /// Waits, at most 5 s, until the log reports a failed append (one
    /// happens only once a write is noted).
    #[cfg(test)]
    pub(crate) async fn until_log_fails(&self) -> failing::Failure {
        until("the log reports its failure", || self.log_failure()).await
    }

    /// Waits, at most 5 s, until sled's work reports a failure (an
    /// application fails only once a write is noted).
    #[cfg(test)]
    pub(crate) async fn until_sled_fails(&self) -> failing::Failure {
        until("sled's work reports its failure", || self.sled_failure()).await
    }

    /// Opens the ledger with its applier thread stopped, so a test decides
    /// when pending writes reach sled (`apply_pending`), not a timer.
    #[cfg(test)]
    fn open_with_applier_paused(dir: &Path) -> Result<Self, LedgerError> {
        Self::open_with_applier(dir, ApplierStart::Paused)
    }

    fn open_with_applier(dir: &Path, start: ApplierStart) -> Result<Self, LedgerError> {
        let db = open_sled(dir)?;
        let tree = db.open_tree("ledger")?;
        check_format(&tree)?;
        let wal_dir = dir.join("wal");
        let next_segment = wal::segments(&wal_dir)
            .map_err(storage_io)?
            .last()
            .map_or(1, |(number, _)| number + 1);
        let replayed = wal::read_all(&wal_dir).map_err(storage_io)?;
        let durable = Arc::new(durable::DurableMark::default());
        let applier = Applier::new(db.clone(), tree.clone(), wal_dir.clone(), durable.clone())?;
        applier.recover(PendingSet::from_log(replayed, |id| {
            applier.stored_task(id)
        })?)?;
        remove_retired_index(&tree)?;
        // Before the applier starts: its thread would outlive a failed open,
        // holding sled's lock.
        let segment = wal::Segment::create(&wal_dir, next_segment).map_err(storage_io)?;
        if start == ApplierStart::Running {
            applier.start();
        }
        let hub = Arc::new(EventHub::default());
        let flusher = Flusher::start(segment, durable, hub.clone(), applier.clone());
        let push_configs_stored = tree.scan_prefix(keys::push_all_prefix()).count() as u64;
        Ok(Self {
            tree,
            write_lock: Mutex::new(Vec::new()),
            flusher,
            applier,
            hub,
            push_configs_stored: Arc::new(AtomicU64::new(push_configs_stored)),
            transitions: OnceLock::new(),
            instance: uuid::Uuid::new_v4().as_u64_pair().0.max(1),
        })
    }

    /// Names this opening of the ledger, as against those before a restart.
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// Tells `observer` of every state change an update makes from now on
    /// (not of a task's first state, which its creation sets). A ledger has
    /// one observer: a second is refused, with a warning.
    pub fn observe_transitions(&self, observer: TransitionObserver) {
        if self.transitions.set(observer).is_err() {
            tracing::warn!(
                "the ledger's state changes are observed already; a second observer is not told"
            );
        }
    }

    /// Where durable events are fanned out.
    pub fn hub(&self) -> &Arc<EventHub> {
        &self.hub
    }

    /// How much the log's group commit has gathered since the ledger opened.
    pub fn log_figures(&self) -> flusher::LogFigures {
        self.flusher.figures()
    }

    /// What is failing, while the log cannot make writes durable; writes
    /// noted meanwhile wait until it can.
    pub fn log_failure(&self) -> Option<failing::Failure> {
        self.flusher.failure()
    }

    /// What is failing, while writes cannot be applied to sled or sled
    /// cannot be checkpointed; the log keeps the writes meanwhile, and
    /// grows.
    pub fn sled_failure(&self) -> Option<failing::Failure> {
        self.applier.failure()
    }

    /// What keeps the ledger from taking new work: a log that cannot make
    /// writes durable, or sled failing. sled 0.34 refuses every write once
    /// one of its own failed, until it is opened again, so its failure
    /// usually lasts until Baton restarts (which applies the log).
    pub fn failure(&self) -> Option<failing::Failure> {
        self.log_failure().or_else(|| self.sled_failure())
    }

    /// Applications to sled and checkpoints that failed since the ledger
    /// opened, each tried again.
    pub fn sled_failed_attempts(&self) -> u64 {
        self.applier.failed_attempts()
    }

    /// Waits until every write made so far is on disk.
    pub async fn sync(&self) {
        let ticket = self.flusher.latest_ticket();
        self.flusher.wait_durable(ticket).await;
    }

    /// As [`Ledger::sync`], but answers `Unavailable` while the log cannot
    /// make writes durable, instead of waiting for it to recover.
    pub async fn sync_unless_failing(&self) -> Result<(), LedgerError> {
        self.until_durable(self.flusher.latest_ticket()).await
    }

    /// Makes everything durable, moves it into sled, and stops the
    /// background threads; call once at shutdown.
    pub fn close(&self) {
        self.flusher.stop();
        self.applier.stop();
    }

    /// Reads a task.
    pub fn get(&self, task_id: &str) -> Result<Option<TaskRecord>, LedgerError> {
        Ok(self.get_shared(task_id)?.map(Arc::unwrap_or_clone))
    }

    /// Reads a task without copying a record that has writes pending.
    pub fn get_shared(&self, task_id: &str) -> Result<Option<Arc<TaskRecord>>, LedgerError> {
        self.get_for_reply(task_id)?
            .map(ReplyTask::into_record)
            .transpose()
    }

    /// Reads a task for a reply, decoding nothing sled holds.
    pub fn get_for_reply(&self, task_id: &str) -> Result<Option<ReplyTask>, LedgerError> {
        self.read_for_reply(task_id, None)
    }

    /// A task from the writes not yet in sled, else from sled; a listing,
    /// which holds [`Applier::applied`], reads record buckets through `memo`.
    fn read_for_reply(
        &self,
        task_id: &str,
        memo: Option<&mut applier::BucketMemo>,
    ) -> Result<Option<ReplyTask>, LedgerError> {
        if let Some(read) = self.applier.task(task_id) {
            return Ok(Some(ReplyTask::Read(read)));
        }
        match self.applier.stored_record(task_id, memo)? {
            Some(bytes) => Ok(Some(ReplyTask::Stored(StoredRecord { bytes }))),
            None => Ok(None),
        }
    }

    /// Creates a task and appends its first events, durably. The id must be
    /// new (a second create of one id would restart its event log): Baton
    /// makes every task id itself (UUIDv7), so nothing is read to check:
    /// a sled read would cost every send a lookup.
    pub async fn create(
        &self,
        record: TaskRecord,
        events: Vec<StreamResponse>,
    ) -> Result<Arc<TaskRecord>, LedgerError> {
        Ok(self
            .create_within(record, events, TaskLimits::NONE)
            .await?
            .record)
    }

    /// Creates a task as [`Ledger::create`] does, unless its events would
    /// pass `limits`: then from its first event alone (for a task the
    /// gateway creates, its snapshot: the caller's message), which is not
    /// checked. The record's other fields are kept.
    pub async fn create_within(
        &self,
        mut record: TaskRecord,
        events: Vec<StreamResponse>,
        limits: TaskLimits,
    ) -> Result<CreatedTask, LedgerError> {
        debug_assert!(
            matches!(self.get_shared(&record.task.id), Ok(None)),
            "task {} exists already",
            record.task.id
        );
        // A new task is nobody else's yet, so it is encoded before the
        // write lock, which concurrent writers queue on.
        let mut published = Self::append_events(&mut record, events)?;
        record.version = 1;
        let mut cut = None;
        if record.last_seq > limits.max_events {
            (record, published) = Self::first_event_only(record, published)?;
            cut = Some(TaskLimit::Events);
        }
        let mut encoded = EncodedTask::new(record, published, true)?;
        if cut.is_none() && encoded.len() > limits.max_bytes {
            let EncodedTask {
                record, published, ..
            } = encoded;
            let (record, published) = Self::first_event_only(record, published)?;
            encoded = EncodedTask::new(record, published, true)?;
            cut = Some(TaskLimit::Bytes);
        }
        let (record, ticket) = {
            let mut frames = self.write_lock.lock().expect("ledger lock");
            self.log_task(&mut frames, encoded)?
        };
        self.wait_written(ticket).await;
        Ok(CreatedTask { record, cut })
    }

    /// A new task's record and events again, holding its first event alone:
    /// the task and its last hop's end as they were before any event.
    fn first_event_only(
        mut record: TaskRecord,
        published: Vec<Arc<LedgerEvent>>,
    ) -> Result<(TaskRecord, Vec<Arc<LedgerEvent>>), LedgerError> {
        let first = published
            .into_iter()
            .take(1)
            .map(|event| Arc::try_unwrap(event).map_or_else(|e| e.event.clone(), |e| e.event))
            .collect();
        record.task = Task {
            id: std::mem::take(&mut record.task.id),
            context_id: std::mem::take(&mut record.task.context_id),
            ..Task::default()
        };
        record.last_seq = 0;
        // An end the dropped events made (a settled state) is no end now.
        if let Some(hop) = record.hops.last_mut() {
            (hop.ended_at, hop.state, hop.reason) = (None, None, None);
        }
        let published = Self::append_events(&mut record, first)?;
        Ok((record, published))
    }

    /// Changes a task durably. `change` may edit the record (history, upstream
    /// ids) and returns the events to append (a `Vec` of events converts into
    /// [`Change::Made`]); each event goes through the lifecycle rules. Nothing
    /// is written if `change` or a rule fails, or if it reports
    /// [`Change::Unchanged`]; then the record as read is returned once it is
    /// durable.
    pub async fn update<F, C, E>(&self, task_id: &str, change: F) -> Result<Arc<TaskRecord>, E>
    where
        F: FnOnce(&mut TaskRecord) -> Result<C, E>,
        C: Into<Change>,
        E: From<LedgerError>,
    {
        self.update_within(task_id, TaskLimits::NONE, change).await
    }

    /// [`Self::update`], unless the change would pass `limits`: append
    /// events past `max_events` ([`LedgerError::TooManyEvents`]), or make
    /// the task's record (as encoded, the bytes every later write rewrites)
    /// longer than `max_bytes` ([`LedgerError::RecordTooLarge`]). Then
    /// nothing is written.
    pub async fn update_within<F, C, E>(
        &self,
        task_id: &str,
        limits: TaskLimits,
        change: F,
    ) -> Result<Arc<TaskRecord>, E>
    where
        F: FnOnce(&mut TaskRecord) -> Result<C, E>,
        C: Into<Change>,
        E: From<LedgerError>,
    {
        let written = {
            let mut frames = self.write_lock.lock().expect("ledger lock");
            let read = self
                .get_shared(task_id)?
                .ok_or_else(|| LedgerError::NotFound(task_id.to_string()))?;
            // A refusal quotes what was read, which may be a pending write.
            let refused = |err: E| Err((err, self.flusher.latest_ticket()));
            let mut record = TaskRecord::clone(&read);
            match change(&mut record).map(Into::into) {
                Err(err) => refused(err),
                // The record as read, not the closure's copy; it may be a
                // pending write, so that is waited for too.
                Ok(Change::Unchanged) => Ok((read, self.flusher.latest_ticket())),
                Ok(Change::Made(events)) => 'made: {
                    let published = Self::append_events(&mut record, events)?;
                    // A write of no event leaves the count as it was.
                    if !published.is_empty() && record.last_seq > limits.max_events {
                        let (events, limit) = (record.last_seq, limits.max_events);
                        break 'made refused(LedgerError::TooManyEvents { events, limit }.into());
                    }
                    record.version += 1;
                    let (from, to) = (read.task.status.state, record.task.status.state);
                    let encoded = EncodedTask::after(&read, record, published)?;
                    let bytes = encoded.len();
                    if bytes > limits.max_bytes {
                        let limit = limits.max_bytes;
                        break 'made refused(LedgerError::RecordTooLarge { bytes, limit }.into());
                    }
                    let logged = self.log_task(&mut frames, encoded)?;
                    // Told once logged, before the flusher can make the write
                    // durable: a reply may go out as soon as it is, and a
                    // scrape after that reply counts it.
                    if from != to
                        && let Some(observe) = self.transitions.get()
                    {
                        let since = read.task.status.timestamp.unwrap_or(read.created_at);
                        observe(from, to, (Utc::now() - since).to_std().unwrap_or_default());
                    }
                    Ok(logged)
                }
            }
        };
        match written {
            Ok((record, ticket)) => {
                self.wait_written(ticket).await;
                Ok(record)
            }
            // Once what it quotes is durable; while the log cannot append,
            // its failure is the answer.
            Err((refusal, ticket)) => {
                self.until_durable(ticket).await?;
                Err(refusal)
            }
        }
    }

    /// Waits until the log write with `ticket` is durable: a reply shaped
    /// from a read waits for the read's ticket, so that it never shows
    /// state a crash could still take back. At once when it is durable;
    /// while the log cannot append, fails at once rather than keep the
    /// reader waiting.
    pub async fn until_durable(&self, ticket: u64) -> Result<(), LedgerError> {
        self.flusher
            .wait_durable_unless_failing(ticket)
            .await
            .map_err(|failure| LedgerError::Unavailable(failure.to_string()))
    }

    /// Waits until the write with `ticket` is durable; call it once the
    /// write lock is released. On the way it frees one set the applier is
    /// done with, on this thread, where its memory was allocated (see
    /// [`Applier::free_spent`]).
    async fn wait_written(&self, ticket: u64) {
        self.applier.free_spent();
        self.flusher.wait_durable(ticket).await;
    }

    /// Logs a task write and queues it for sled; runs under the write lock.
    /// Returns the record as the overlay shares it, and the write's ticket.
    fn log_task(
        &self,
        frames: &mut Vec<u8>,
        encoded: EncodedTask,
    ) -> Result<(Arc<TaskRecord>, u64), LedgerError> {
        let EncodedTask {
            record,
            frame,
            published,
            created,
        } = encoded;
        frames.clear();
        let events = if logs_events(&record) {
            published
                .iter()
                .map(|e| Ok((e.seq, e.json()?)))
                .collect::<Result<_, LedgerError>>()?
        } else {
            Vec::new()
        };
        let encoded = match frame {
            TaskFrame::Whole { json, task_json } => {
                let entry = wal::EntryRef::Task {
                    record: &json,
                    events,
                };
                wal::encode(frames, &entry)?;
                Some(applier::Encoded { json, task_json })
            }
            // sled stores whole records: the applier encodes this one when
            // it applies it, once for all the writes it coalesced.
            TaskFrame::Additions { head, additions } => {
                let entry = wal::EntryRef::TaskAppend {
                    head: &head,
                    history_from: additions.history_from,
                    history: &record.task.history[additions.history_from..],
                    artifacts: &additions.artifacts,
                    events,
                };
                wal::encode(frames, &entry)?;
                None
            }
        };
        let record = Arc::new(record);
        // The overlay has the write before the flusher can publish it.
        let ticket = self
            .flusher
            .note_write(frames, published, |ticket, published| {
                self.applier
                    .add_task(record.clone(), encoded, published, ticket, created)
            });
        Ok((record, ticket))
    }

    /// Logs a raw key write and queues it for sled; runs under the write lock.
    fn log_raw(
        &self,
        frames: &mut Vec<u8>,
        key: Vec<u8>,
        value: Option<Vec<u8>>,
    ) -> Result<u64, LedgerError> {
        frames.clear();
        let entry = match &value {
            Some(value) => wal::EntryRef::Put { key: &key, value },
            None => wal::EntryRef::Remove { key: &key },
        };
        wal::encode(frames, &entry)?;
        Ok(self.flusher.note_write(frames, Vec::new(), |ticket, _| {
            self.applier.set_raw(key, value, ticket)
        }))
    }

    /// Sets (`Some`) or removes (`None`) a raw key, durably.
    async fn write_raw(&self, key: Vec<u8>, value: Option<Vec<u8>>) -> Result<(), LedgerError> {
        let ticket = {
            let mut frames = self.write_lock.lock().expect("ledger lock");
            self.log_raw(&mut frames, key, value)?
        };
        self.wait_written(ticket).await;
        Ok(())
    }

    /// Reads a raw key, pending writes included.
    fn read_raw(&self, key: &[u8]) -> Result<Option<Vec<u8>>, LedgerError> {
        Ok(self.read_raw_at(key)?.0)
    }

    /// Reads a raw key, pending writes included, with the log ticket that
    /// makes what it read durable (0: it is).
    fn read_raw_at(&self, key: &[u8]) -> Result<(Option<Vec<u8>>, u64), LedgerError> {
        if let Some(pending) = self.applier.raw(key) {
            return Ok((pending.value, pending.ticket));
        }
        Ok((self.tree.get(key)?.map(|value| value.to_vec()), 0))
    }

    fn append_events(
        record: &mut TaskRecord,
        events: Vec<StreamResponse>,
    ) -> Result<Vec<Arc<LedgerEvent>>, LedgerError> {
        let mut published = Vec::with_capacity(events.len());
        for event in events {
            lifecycle::apply_event(&mut record.task, &event)?;
            record.last_seq += 1;
            published.push(Arc::new(LedgerEvent::new(
                record.task.id.clone(),
                record.last_seq,
                event,
            )));
        }
        Ok(published)
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
        let _applied = self.applier.applied()?;
        self.tree
            .scan_prefix(prefix)
            .keys()
            .map(|key| Ok(String::from_utf8_lossy(&key?[prefix.len()..]).into_owned()))
            .collect()
    }

    /// The events of a task after `seq`, in order, once durable: a page of
    /// them at a time (see [`ReplayPage`]); for a task that ended, its final
    /// snapshot in place of the events after its last logged one.
    pub async fn durable_events_after(
        &self,
        task_id: &str,
        seq: u64,
    ) -> Result<ReplayPage, LedgerError> {
        let (page, ticket) = self.events_after(task_id, seq)?;
        self.until_durable(ticket).await?;
        Ok(page)
    }

    /// [`Ledger::durable_events_after`] as read, and the log ticket to wait
    /// for before they are shown: the logged events are in sled, so durable,
    /// but a final snapshot may be a write still on its way to disk.
    fn events_after(&self, task_id: &str, seq: u64) -> Result<(ReplayPage, u64), LedgerError> {
        let _applied = self.applier.applied()?;
        let prefix = keys::events_prefix(task_id);
        let wanted = keys::event(task_id, seq + 1);
        // Events are stored in chunks keyed by their first sequence number:
        // start at the chunk that holds `seq + 1`.
        let start = match self.tree.range(prefix.clone()..=wanted.clone()).next_back() {
            Some(entry) => entry?.0.to_vec(),
            None => prefix.clone(),
        };
        // A page at most: a lagging stream holds that, not the task's whole log.
        let mut page = ReplayPage::default();
        let mut bytes = 0;
        'chunks: for entry in self.tree.range(start..) {
            let (key, value) = entry?;
            if !key.starts_with(&prefix) {
                break;
            }
            let seq_bytes: [u8; 8] = key[prefix.len()..].try_into().unwrap_or([0; 8]);
            let first = u64::from_be_bytes(seq_bytes);
            // A chunk is a JSON array; ledgers written before chunks hold one
            // event a key. Split, not decoded: a chunk may hold a task's
            // whole log (one applied at a start-up), and a page decodes only
            // the events it returns.
            let chunk: Vec<&serde_json::value::RawValue> = if value.first() == Some(&b'[') {
                decode_stored(&value)?
            } else {
                vec![decode_stored(&value)?]
            };
            for (offset, raw) in chunk.into_iter().enumerate() {
                let event_seq = first + offset as u64;
                if event_seq <= seq {
                    continue;
                }
                if page.events.len() >= REPLAY_PAGE_EVENTS || bytes >= REPLAY_PAGE_BYTES {
                    page.more = true;
                    break 'chunks;
                }
                bytes += raw.get().len();
                let event = decode_stored(raw.get().as_bytes())?;
                page.events
                    .push(LedgerEvent::new(task_id.to_string(), event_seq, event));
            }
        }
        if page.more {
            return Ok((page, 0));
        }
        // The last events of a task that ended are not logged: its final
        // snapshot stands for them (the spec lets a stream end with one).
        let logged = page.events.last().map_or(seq, |e| e.seq);
        let mut ticket = 0;
        if let Some(record) = self.get_shared(task_id)?
            && record.last_seq > logged
            && record.task.status.state.is_terminal()
        {
            // Every write so far, the one read among them.
            ticket = self.flusher.latest_ticket();
            let snapshot = StreamResponse::Task(record.task.view(None, true));
            page.events.push(LedgerEvent::new(
                task_id.to_string(),
                record.last_seq,
                snapshot,
            ));
        }
        Ok((page, ticket))
    }

    /// One page of an owner's tasks, newest status first.
    pub fn list(&self, owner: &str, query: &ListQuery) -> Result<ListPage, LedgerError> {
        let _applied = self.applier.applied()?;
        let plan = self.plan(owner, query)?;
        let mut page = ListPage::default();
        let mut last_order: Option<Vec<u8>> = None;
        let mut memo = applier::BucketMemo::default();
        for suffix in plan.entries(&self.tree, query.page_token.as_deref())? {
            let suffix = suffix?;
            let record = match plan.check(self, &suffix, &mut memo)? {
                Verdict::Stop => break,
                Verdict::Skip => continue,
                Verdict::Match(Some(task)) => task,
                Verdict::Match(None) => {
                    let listed = keys::parse_order(&suffix)
                        .and_then(|(_, id)| self.read_for_reply(id, Some(&mut memo)).transpose());
                    match listed {
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
            last_order = Some(suffix);
            page.records.push(record);
        }
        page.total_size = self.count(owner, query, &plan)?;
        Ok(page)
    }

    /// The index plan of a query, with the task a queried context was
    /// minted for when that task is the owner's and still in the context.
    fn plan(&self, owner: &str, query: &ListQuery) -> Result<IndexPlan, LedgerError> {
        let mut plan = IndexPlan::new(owner, query);
        if let Some(context) = &query.context_id
            && let Some(task_id) = keys::minting_task(context)
            && let Some(record) = self.get_shared(&task_id)?
            && record.owner == owner
            && record.task.context_id == *context
        {
            plan.minted_first = Some(keys::order(record.task.status.timestamp, &task_id));
        }
        Ok(plan)
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
            (None, None, None) => Some(keys::counter(owner, "all")),
            (None, Some(state), None) => Some(keys::state_counter(owner, state.number())),
            // A context holds few tasks: its index is counted, which spares
            // every new context a counter key.
            _ => None,
        };
        if let Some(key) = counter {
            return Ok(read_counter(&self.tree, &key)? as usize);
        }
        let mut total = 0;
        let mut memo = applier::BucketMemo::default();
        for suffix in plan.entries(&self.tree, None)? {
            match plan.check(self, &suffix?, &mut memo)? {
                Verdict::Stop => break,
                Verdict::Skip => {}
                Verdict::Match(_) => total += 1,
            }
        }
        Ok(total)
    }

    /// Stores a push config durably, replacing one with the same id, unless
    /// it would be a new one beside `most` its task holds already: then it
    /// returns `Err(held)`.
    pub async fn put_push_config(
        &self,
        config: &TaskPushNotificationConfig,
        most: usize,
    ) -> Result<Result<(), usize>, LedgerError> {
        let value = serde_json::to_vec(config)?;
        self.write_push_config(&config.task_id, &config.id, Some(value), most)
            .await
    }

    /// Sets (`Some`) or removes (`None`) a push config key, keeping the count
    /// of stored configs and the config's delivery mark; a new key beside
    /// `most` of its task's is refused with `Err(held)`. Counted and written
    /// under the write lock, so two concurrent creates cannot both pass the
    /// cap, and an event is either before a new config's mark or after it.
    async fn write_push_config(
        &self,
        task_id: &str,
        config_id: &str,
        value: Option<Vec<u8>>,
        most: usize,
    ) -> Result<Result<(), usize>, LedgerError> {
        let key = keys::push_config(task_id, config_id);
        let ticket = {
            let mut frames = self.write_lock.lock().expect("ledger lock");
            let was_set = self.read_raw(&key)?.is_some();
            let sets = value.is_some();
            if sets && !was_set {
                let held = self.scan_raw(&keys::push_prefix(task_id))?.len();
                if held >= most {
                    return Ok(Err(held));
                }
            }
            // A new config is owed the events after the task's latest (all
            // of a task its send has yet to create); a replaced one keeps
            // its mark; a deleted one's goes with it.
            let mark = match (was_set, sets) {
                (false, true) => Some(Some(self.events_through(task_id)?.unwrap_or_default())),
                (true, false) => Some(None),
                _ => None,
            };
            let mut ticket = self.log_raw(&mut frames, key, value)?;
            if let Some(mark) = mark {
                if mark.is_some() {
                    self.push_configs_stored.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.push_configs_stored.fetch_sub(1, Ordering::Relaxed);
                }
                let mark_key = keys::push_mark(task_id, config_id);
                ticket = self.log_raw(&mut frames, mark_key, mark.map(PushMark::encode))?;
            }
            ticket
        };
        self.wait_written(ticket).await;
        Ok(Ok(()))
    }

    /// Notes that a push config's notifications through event
    /// `handled.through` were delivered or given up, and whether the task
    /// had ended with them: a restart owes that config nothing up to there
    /// ([`Ledger::push_backlog`]). Not waited for: a mark a crash loses
    /// only repeats a notification. A deleted config gets no mark, and a
    /// mark never moves back.
    pub fn note_push_handled(
        &self,
        task_id: &str,
        config_id: &str,
        handled: PushMark,
    ) -> Result<(), LedgerError> {
        let mut frames = self.write_lock.lock().expect("ledger lock");
        if self
            .read_raw(&keys::push_config(task_id, config_id))?
            .is_none()
        {
            return Ok(());
        }
        let noted = self.push_mark(task_id, config_id)?;
        let marked = noted.map_or(handled, |noted| noted.joined(handled));
        if noted != Some(marked) {
            let key = keys::push_mark(task_id, config_id);
            self.log_raw(&mut frames, key, Some(marked.encode()))?;
        }
        Ok(())
    }

    /// How far the notifications of push config `config_id` of `task_id`
    /// were handled (see [`Ledger::note_push_handled`]); `None` for a config
    /// without a mark.
    pub fn push_mark(
        &self,
        task_id: &str,
        config_id: &str,
    ) -> Result<Option<PushMark>, LedgerError> {
        let mark = self.read_raw(&keys::push_mark(task_id, config_id))?;
        Ok(mark.and_then(|bytes| PushMark::decode(&bytes)))
    }

    /// The push configs a restart owes a notification, by task: those
    /// whose task has events past the config's mark, unless the task's end
    /// was handled already. A config without a mark (stored before marks
    /// were kept) is owed nothing, and neither is one of a task never
    /// created (its send failed before it existed).
    pub fn push_backlog(&self) -> Result<Vec<(String, Vec<String>)>, LedgerError> {
        if self.push_configs_stored.load(Ordering::Relaxed) == 0 {
            return Ok(Vec::new());
        }
        let mark_prefix = keys::push_mark_all_prefix();
        let mut marks = std::collections::HashMap::new();
        for (key, value) in self.scan_raw(&mark_prefix)? {
            if let (Some((task_id, config_id)), Some(mark)) = (
                keys::split_push_key(&key, &mark_prefix),
                PushMark::decode(&value),
            ) {
                marks.insert((task_id.to_string(), config_id.to_string()), mark);
            }
        }
        let config_prefix = keys::push_all_prefix();
        let mut owed: Vec<(String, Vec<String>)> = Vec::new();
        // Configs come in task order, so one read serves a task's configs.
        let mut read: Option<(String, Option<PushMark>)> = None;
        for key in self.scan_raw(&config_prefix)?.into_keys() {
            let Some((task_id, config_id)) = keys::split_push_key(&key, &config_prefix) else {
                continue;
            };
            let Some(mark) = marks.get(&(task_id.to_string(), config_id.to_string())) else {
                continue;
            };
            if mark.task_ended {
                continue;
            }
            if read.as_ref().is_none_or(|(read_id, _)| read_id != task_id) {
                read = Some((task_id.to_string(), self.events_through(task_id)?));
            }
            let Some((_, Some(events))) = &read else {
                continue;
            };
            if events.through <= mark.through {
                continue;
            }
            match owed.last_mut() {
                Some((owed_id, configs)) if owed_id == task_id => {
                    configs.push(config_id.to_string())
                }
                _ => owed.push((task_id.to_string(), vec![config_id.to_string()])),
            }
        }
        Ok(owed)
    }

    /// How far a task's events go (`None`: no such task), read without
    /// decoding a stored record.
    fn events_through(&self, task_id: &str) -> Result<Option<PushMark>, LedgerError> {
        self.get_for_reply(task_id)?
            .map(|task| task.events_through())
            .transpose()
    }

    /// How many push configs the ledger holds, shared: push delivery skips
    /// its per-event lookup while there are none.
    pub fn push_config_count(&self) -> Arc<AtomicU64> {
        self.push_configs_stored.clone()
    }

    /// Reads one push config, once what it read is durable: a config
    /// whose create or delete is still on its way to disk is shown as it
    /// will be after a crash too.
    pub async fn get_push_config(
        &self,
        task_id: &str,
        config_id: &str,
    ) -> Result<Option<TaskPushNotificationConfig>, LedgerError> {
        let (found, ticket) = self.read_raw_at(&keys::push_config(task_id, config_id))?;
        self.until_durable(ticket).await?;
        match found {
            Some(bytes) => Ok(Some(decode_stored(&bytes)?)),
            None => Ok(None),
        }
    }

    /// Every push config of a task, by id, once what it read is durable.
    pub async fn push_configs(
        &self,
        task_id: &str,
    ) -> Result<Vec<TaskPushNotificationConfig>, LedgerError> {
        // Read on every event (push delivery): merges pending writes rather
        // than applying them here.
        let (found, ticket) = self.scan_raw_at(&keys::push_prefix(task_id))?;
        self.until_durable(ticket).await?;
        found
            .values()
            .map(|value| Ok(decode_stored(value)?))
            .collect()
    }

    /// The raw keys under `prefix` with their values, pending writes included.
    fn scan_raw(&self, prefix: &[u8]) -> Result<RawEntries, LedgerError> {
        Ok(self.scan_raw_at(prefix)?.0)
    }

    /// [`Ledger::scan_raw`], with the log ticket that makes what it read
    /// durable: the newest of the pending writes it merged (0: none).
    fn scan_raw_at(&self, prefix: &[u8]) -> Result<(RawEntries, u64), LedgerError> {
        // The overlay is read first: a write it no longer holds was applied
        // before, so the sled scan after it sees that write. (A write racing
        // the scan may show its old or its new value, as for any read.)
        let pending = self.applier.raw_under(prefix);
        let mut found = std::collections::BTreeMap::new();
        for entry in self.tree.scan_prefix(prefix) {
            let (key, value) = entry?;
            found.insert(key.to_vec(), value.to_vec());
        }
        let mut ticket = 0;
        for (key, write) in pending {
            ticket = ticket.max(write.ticket);
            match write.value {
                Some(value) => found.insert(key, value),
                None => found.remove(&key),
            };
        }
        Ok((found, ticket))
    }

    /// Deletes a push config durably; deleting a missing one is not an error.
    pub async fn delete_push_config(
        &self,
        task_id: &str,
        config_id: &str,
    ) -> Result<(), LedgerError> {
        // Removing is never refused.
        self.write_push_config(task_id, config_id, None, usize::MAX)
            .await
            .map(drop)
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
            let mut frames = self.write_lock.lock().expect("ledger lock");
            if let Some(existing) = self.read_raw(&db_key)? {
                return Ok(Some(decode_stored(&existing)?));
            }
            self.log_raw(&mut frames, db_key, Some(serde_json::to_vec(record)?))?
        };
        self.wait_written(ticket).await;
        Ok(None)
    }

    /// Stores a registered agent durably (any JSON-serializable record).
    pub async fn put_agent<T: Serialize>(
        &self,
        agent_id: &str,
        record: &T,
    ) -> Result<(), LedgerError> {
        self.write_raw(keys::agent(agent_id), Some(serde_json::to_vec(record)?))
            .await
    }

    /// Deletes a registered agent durably, keeping which agency held its
    /// id (written first: a crash between the two leaves the agent with a
    /// record of its own agency, which changes nothing).
    pub async fn delete_agent(&self, agent_id: &str, owner: &str) -> Result<(), LedgerError> {
        let held_by = serde_json::to_vec(owner)?;
        self.write_raw(keys::retired_agent(agent_id), Some(held_by))
            .await?;
        self.write_raw(keys::agent(agent_id), None).await
    }

    /// Writes `value` under `key` as it is: tests store what no method
    /// would (a record that does not decode).
    #[cfg(test)]
    pub(crate) async fn put_raw(&self, key: Vec<u8>, value: Vec<u8>) -> Result<(), LedgerError> {
        self.write_raw(key, Some(value)).await
    }

    /// The agency that held `agent_id` when it was deregistered, if it was.
    pub fn retired_agent_owner(&self, agent_id: &str) -> Result<Option<String>, LedgerError> {
        match self.read_raw(&keys::retired_agent(agent_id))? {
            Some(held_by) => Ok(Some(decode_stored(&held_by)?)),
            None => Ok(None),
        }
    }

    /// Every deregistered agent id, with the agency that held it.
    pub fn retired_agents(&self) -> Result<Vec<(String, String)>, LedgerError> {
        let prefix = keys::retired_agent("");
        self.scan_raw(&prefix)?
            .iter()
            .map(|(key, value)| {
                let id = String::from_utf8_lossy(&key[prefix.len()..]).into_owned();
                Ok((id, decode_stored(value)?))
            })
            .collect()
    }

    /// The ids of a task's child tasks (handoffs it started).
    pub fn children(&self, parent_task_id: &str) -> Result<Vec<String>, LedgerError> {
        let _applied = self.applier.applied()?;
        let prefix = keys::child(parent_task_id, "");
        self.tree
            .scan_prefix(&prefix)
            .keys()
            .map(|key| Ok(String::from_utf8_lossy(&key?[prefix.len()..]).into_owned()))
            .collect()
    }

    /// Every registered agent, by id.
    pub fn agents<T: serde::de::DeserializeOwned>(&self) -> Result<Vec<T>, LedgerError> {
        self.scan_raw(&keys::agent(""))?
            .values()
            .map(|value| Ok(decode_stored(value)?))
            .collect()
    }

    /// Forgets an idempotency key whose send created nothing.
    pub async fn release_idempotency(&self, owner: &str, key: &str) -> Result<(), LedgerError> {
        self.write_raw(keys::idempotency(owner, key), None).await
    }

    /// Removes the idempotency record of `key` if it is still `expected`;
    /// false if it was changed or removed meanwhile (a concurrent claim is
    /// never taken away).
    pub async fn release_idempotency_if(
        &self,
        owner: &str,
        key: &str,
        expected: &IdempotencyRecord,
    ) -> Result<bool, LedgerError> {
        let db_key = keys::idempotency(owner, key);
        let ticket = {
            let mut frames = self.write_lock.lock().expect("ledger lock");
            match self.read_raw(&db_key)? {
                Some(bytes) if decode_stored::<IdempotencyRecord>(&bytes)? == *expected => {}
                _ => return Ok(false),
            }
            self.log_raw(&mut frames, db_key, None)?
        };
        self.wait_written(ticket).await;
        Ok(true)
    }

    /// Reads an idempotency record without claiming it.
    pub fn claim_idempotency_peek(
        &self,
        owner: &str,
        key: &str,
    ) -> Result<Option<IdempotencyRecord>, LedgerError> {
        match self.read_raw(&keys::idempotency(owner, key))? {
            Some(bytes) => Ok(Some(decode_stored(&bytes)?)),
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
        let value = serde_json::to_vec(record)?;
        self.write_raw(keys::idempotency(owner, key), Some(value))
            .await
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.close();
    }
}

/// Decodes JSON the ledger wrote (log frames, records, event chunks, raw
/// values) without serde_json's nesting limit of 128. A write wraps what
/// was accepted, itself decoded within that limit from a request or an
/// agent's answer, a few levels deeper: under the limit an acknowledged
/// write could fail to read back. Nothing else bounds the depth, and
/// nothing else is needed: only the ledger's own writes come here.
pub(crate) fn decode_stored<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> serde_json::Result<T> {
    let mut decoder = serde_json::Deserializer::from_slice(bytes);
    decoder.disable_recursion_limit();
    let value = T::deserialize(&mut decoder)?;
    decoder.end()?;
    Ok(value)
}

/// Maps keyed by task ids, which Baton mints: looked up several times per
/// send, where SipHash showed in profiles. (foldhash resists only simple
/// collision attacks, so keys a caller chooses stay on SipHash.)
pub(crate) type TaskMap<V> = foldhash::HashMap<String, V>;

/// Whether a ledger opens with its applier thread running.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ApplierStart {
    Running,
    /// Tests move pending writes into sled themselves (`apply_pending`).
    #[cfg(test)]
    Paused,
}

/// Whether a write of `record` logs its events. A terminal task's events
/// are never applied from the log (the applier keeps no event log for
/// them), so they are not encoded for it; subscribers get them from memory.
fn logs_events(record: &TaskRecord) -> bool {
    !record.task.status.state.is_terminal()
}

/// A task write with its JSON, encoded once for the log and for sled.
struct EncodedTask {
    /// The record after the write, its `logged_len` set.
    record: TaskRecord,
    frame: TaskFrame,
    published: Vec<Arc<LedgerEvent>>,
    /// The write creates the task (the applier then has nothing to read first).
    created: bool,
}

/// How a task write is logged.
enum TaskFrame {
    /// The whole record, as sled stores it too.
    Whole {
        json: Box<RawValue>,
        /// The task's part of `json`, for replies.
        task_json: Arc<RawValue>,
    },
    /// What the write added to a large record (see [`append`]).
    Additions {
        /// The record without its history and artifacts.
        head: Box<RawValue>,
        additions: append::Additions,
    },
}

impl EncodedTask {
    /// Encodes `record` and, if the log takes them, its new events (each
    /// event keeps its JSON for the streams that carry it).
    fn new(
        mut record: TaskRecord,
        published: Vec<Arc<LedgerEvent>>,
        created: bool,
    ) -> Result<Self, LedgerError> {
        let task_json: Arc<RawValue> = serde_json::value::to_raw_value(&record.task)?.into();
        let json = serde_json::value::to_raw_value(&RecordJson::new(&record, &*task_json))?;
        let total = json.get().len();
        record.logged_len = append::LoggedLen { total, body: None };
        Self::encode_events(&record, &published)?;
        Ok(Self {
            record,
            frame: TaskFrame::Whole { json, task_json },
            published,
            created,
        })
    }

    /// Encodes a write that made `record` of `before`: as what it added, if
    /// `before` was large and the write only added to its history and
    /// artifacts; else whole.
    fn after(
        before: &TaskRecord,
        mut record: TaskRecord,
        published: Vec<Arc<LedgerEvent>>,
    ) -> Result<Self, LedgerError> {
        let was = before.logged_len;
        let additions = (was.total >= append::APPEND_FROM)
            .then(|| append::additions(&before.task, &record.task))
            .flatten();
        let Some(additions) = additions else {
            return Self::new(record, published, false);
        };
        // Counted at the first such write, then carried from write to write.
        let body = match was.body {
            Some(body) => body,
            None => append::body_len(&before.task)?,
        };
        let growth = append::growth(&before.task, &record.task, &additions)?;
        // A hint that cannot be right: the record is logged whole.
        let Ok(body) = usize::try_from(body as i64 + growth) else {
            return Self::new(record, published, false);
        };
        let head = append::head_json(&mut record)?;
        let total = head.get().len() + body;
        debug_assert_eq!(total, append::encoded_len(&record)?, "the counted length");
        record.logged_len = append::LoggedLen {
            total,
            body: Some(body),
        };
        Self::encode_events(&record, &published)?;
        Ok(Self {
            record,
            frame: TaskFrame::Additions { head, additions },
            published,
            created: false,
        })
    }

    /// Encodes the events the log takes, which keep their JSON.
    fn encode_events(
        record: &TaskRecord,
        published: &[Arc<LedgerEvent>],
    ) -> Result<(), LedgerError> {
        if logs_events(record) {
            for event in published {
                event.json()?;
            }
        }
        Ok(())
    }

    /// The length of the record's JSON with the write.
    fn len(&self) -> usize {
        self.record.logged_len.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{TaskStatus, TaskStatusUpdateEvent};

    /// A hop written when it noted one escalation answer reads back as a
    /// list of one; a list round-trips.
    #[test]
    fn a_hops_escalation_answers_read_back_from_either_form() {
        let hop = |answers: serde_json::Value| {
            let json = serde_json::json!({"agent": "a", "kind": "direct",
                "startedAt": "2026-12-07T00:00:00Z", "attempts": 1});
            let mut json = json.as_object().unwrap().clone();
            json.extend(answers.as_object().unwrap().clone());
            serde_json::from_value::<HopRecord>(json.into()).unwrap()
        };
        let one = hop(serde_json::json!({"escalationAnswer": 3}));
        assert_eq!(one.escalation_answers, [3]);
        let many = hop(serde_json::json!({"escalationAnswers": [3, 5]}));
        assert_eq!(many.escalation_answers, [3, 5]);
        let written = serde_json::to_value(&many).unwrap();
        assert_eq!(written["escalationAnswers"], serde_json::json!([3, 5]));
        assert!(hop(serde_json::json!({})).escalation_answers.is_empty());
    }

    fn record(task_id: &str) -> TaskRecord {
        TaskRecord {
            task: Task {
                id: task_id.to_string(),
                context_id: "ctx".into(),
                ..Task::default()
            },
            owner: "owner".into(),
            agent: "agent".into(),
            ..TaskRecord::default()
        }
    }

    fn status(task_id: &str, state: TaskState) -> StreamResponse {
        StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: task_id.to_string(),
            context_id: "ctx".into(),
            status: TaskStatus::now(state, None),
            ..TaskStatusUpdateEvent::default()
        })
    }

    async fn flip(ledger: &Ledger, task_id: &str, times: usize) {
        for i in 0..times {
            let state = [TaskState::InputRequired, TaskState::Working][i % 2];
            let event = status(task_id, state);
            ledger
                .update(task_id, |_| Ok::<_, LedgerError>(vec![event]))
                .await
                .unwrap();
        }
    }

    /// A task read for a reply, decoded.
    fn decoded(task: ReplyTask) -> Arc<TaskRecord> {
        task.into_record().expect("a record")
    }

    /// A ledger whose writes reach sled only when the test applies them, so
    /// what coalesces does not depend on the applier's timer.
    fn paused(dir: &Path) -> Ledger {
        Ledger::open_with_applier_paused(dir).unwrap()
    }

    /// `ledger` after creating one WORKING task in it.
    async fn with_working_task(ledger: Ledger, task_id: &str) -> Ledger {
        ledger
            .create(record(task_id), vec![status(task_id, TaskState::Working)])
            .await
            .unwrap();
        ledger
    }

    /// A record with every optional field set.
    fn full_record() -> TaskRecord {
        let upstream = crate::agents::UpstreamRef {
            task_id: "up-1".into(),
            context_id: "up-ctx".into(),
        };
        TaskRecord {
            upstream: Some(upstream.clone()),
            version: 3,
            last_seq: 7,
            created_at: DateTime::from_timestamp(1_700_000_000, 123_456_000).unwrap(),
            parent_task_id: Some("parent".into()),
            return_schema: Some(serde_json::json!({"type": "object"})),
            hops: vec![HopRecord {
                agent: "agent".into(),
                attempts: 1,
                ..HopRecord::default()
            }],
            transfer: Some(TransferSource {
                agent: "source".into(),
                upstream: Some(upstream),
                state: TaskState::Working,
                handoff_id: "h1".into(),
                return_to_parent: true,
                artifacts_before: 2,
                before_digests: vec![11, 12],
                waiting: vec![TransferSource {
                    agent: "first".into(),
                    return_to_parent: true,
                    return_schema: Some(serde_json::json!({"type": "array"})),
                    ..TransferSource::default()
                }],
                return_schema: None,
                source_schema: Some(serde_json::json!({"type": "object"})),
                source_schema_from: 1,
                source_schema_digests: vec![u64::MAX],
                deadline_before: DateTime::from_timestamp(1_700_000_100, 5_000_000),
                max_hops_before: Some(4),
                source_handed_on: vec![SchemaBinding {
                    schema: serde_json::json!({"type": "string"}),
                    from: 0,
                    digests: Vec::new(),
                }],
                released: false,
            }),
            return_schema_from: Some(3),
            return_schema_digests: vec![1, 2, 3],
            return_schema_by_skill: true,
            handed_on_schemas: vec![SchemaBinding {
                schema: serde_json::json!({"type": "number"}),
                from: 4,
                digests: vec![4, 5, 6, 7],
            }],
            ..record("t1")
        }
    }

    /// A thread's nice value.
    #[cfg(target_os = "linux")]
    fn nice_of(thread_id: i32) -> i32 {
        let thread = rustix::process::Pid::from_raw(thread_id).expect("a thread id");
        rustix::process::getpriority_process(Some(thread)).unwrap()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_flusher_runs_at_its_higher_priority_where_the_process_may_raise_one() {
        // Whether this process may raise a thread's priority, tried on a
        // thread of its own.
        let permitted = std::thread::spawn(|| {
            let me = rustix::thread::gettid();
            rustix::process::setpriority_process(Some(me), flusher::FLUSHER_NICE).is_ok()
        })
        .join()
        .unwrap();
        // The flusher starts at the nice of the thread that opens the ledger.
        let own_nice = nice_of(rustix::thread::gettid().as_raw_nonzero().get());
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        let flusher = ledger.flusher.thread_id().expect("the flusher's thread id");
        // Never lowered: a flusher already higher keeps its priority.
        let expected = if permitted {
            own_nice.min(flusher::FLUSHER_NICE)
        } else {
            own_nice
        };
        assert_eq!(nice_of(flusher), expected, "permitted: {permitted}");
        ledger.close();
    }

    /// A flusher started from a thread already above [`flusher::FLUSHER_NICE`]
    /// keeps its priority (raising a thread's nice needs no privilege, so a
    /// plain `setpriority` would lower it).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_flusher_above_its_priority_is_not_lowered() {
        let may_go_higher = std::thread::spawn(|| {
            let me = rustix::thread::gettid();
            rustix::process::setpriority_process(Some(me), flusher::FLUSHER_NICE - 5).is_ok()
        })
        .join()
        .unwrap();
        if !may_go_higher {
            // Unprivileged: no thread here can run above the flusher's nice
            // (`flusher`'s own test covers the rule on any machine).
            return;
        }
        std::thread::spawn(|| {
            let me = rustix::thread::gettid();
            rustix::process::setpriority_process(Some(me), flusher::FLUSHER_NICE - 5).unwrap();
            let dir = tempfile::tempdir().unwrap();
            let ledger = Ledger::open(dir.path()).unwrap();
            let flusher = ledger.flusher.thread_id().expect("the flusher's thread id");
            assert_eq!(nice_of(flusher), flusher::FLUSHER_NICE - 5);
            ledger.close();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_record_written_with_its_task_encoded_apart_reads_back_whole() {
        for record in [record("t1"), full_record()] {
            let whole = serde_json::to_string(&record).unwrap();
            let task_json = serde_json::value::to_raw_value(&record.task).unwrap();
            let spliced = serde_json::to_string(&RecordJson::new(&record, &*task_json)).unwrap();
            assert_eq!(spliced, whole);
            let read: TaskRecord = serde_json::from_str(&whole).unwrap();
            assert_eq!(read, record);
        }
        // Defaults stay out of the record.
        let minimal = serde_json::to_value(record("t1")).unwrap();
        for absent in [
            "upstream",
            "parentTaskId",
            "returnSchema",
            "hops",
            "transfer",
            "returnSchemaFrom",
            "handedOnSchemas",
        ] {
            assert!(minimal.get(absent).is_none(), "{absent} written");
        }
    }

    #[test]
    fn a_transfer_written_before_sources_were_kept_still_reads() {
        let mut whole = serde_json::to_value(full_record()).unwrap();
        let transfer = whole["transfer"].as_object_mut().unwrap();
        transfer.remove("waiting");
        let read: TaskRecord = serde_json::from_value(whole).unwrap();
        let transfer = read.transfer.unwrap();
        assert!(transfer.waiting.is_empty());
        assert_eq!(transfer.result_goes_to().unwrap().agent, "source");
        assert_eq!(transfer.after_return(), None);
    }

    #[test]
    fn a_record_written_before_schema_ranges_were_kept_checks_from_its_transfer() {
        let mut whole = serde_json::to_value(full_record()).unwrap();
        whole.as_object_mut().unwrap().remove("returnSchemaFrom");
        let read: TaskRecord = serde_json::from_value(whole).unwrap();
        assert_eq!(read.return_schema_from, None);
        assert_eq!(read.schema_from(), 2, "the transfer's artifactsBefore");
        assert_eq!(full_record().schema_from(), 3);
        assert_eq!(record("t1").schema_from(), 0);
    }

    #[test]
    fn released_sources_are_known_as_released() {
        let mut transfer = full_record().transfer.unwrap();
        assert!(!transfer.released);
        assert!(!transfer.waiting[0].released);
        let released = transfer.release_waiting().unwrap();
        assert_eq!(released.len(), 2);
        assert!(transfer.released);
        assert!(transfer.waiting[0].released);
        assert_eq!(transfer.release_waiting(), None, "once only");
        let written = serde_json::to_string(&transfer).unwrap();
        let read: TransferSource = serde_json::from_str(&written).unwrap();
        assert!(read.released && read.waiting[0].released);

        // A source that ended its own task is released too, not told.
        let mut finished = TransferSource {
            return_to_parent: true,
            state: TaskState::Canceled,
            ..TransferSource::default()
        };
        assert!(
            !finished.released,
            "a canceled task of its own is no release"
        );
        assert_eq!(finished.release_waiting(), Some(Vec::new()));
        assert!(finished.released);
    }

    #[test]
    fn a_result_meets_its_holders_schema_then_those_handed_on_to_it() {
        let full = full_record();
        let schemas: Vec<_> = full
            .result_schemas()
            .map(|(schema, mark)| (schema["type"].as_str().unwrap(), mark.from, mark.digests))
            .collect();
        assert_eq!(
            schemas,
            [
                ("object", 3, &[1, 2, 3][..]),
                ("number", 4, &[4, 5, 6, 7][..])
            ]
        );
        assert_eq!(record("t1").result_schemas().count(), 0);
    }

    #[test]
    fn a_result_goes_back_through_each_waiting_source_in_turn() {
        let source = |agent: &str, return_to_parent: bool| TransferSource {
            agent: agent.into(),
            return_to_parent,
            ..TransferSource::default()
        };
        let schema = |n: u64| Some(serde_json::json!({"minItems": n}));
        // a -> b (return, schema 1) -> c (no return) -> d (return).
        let to_b = source("a", true);
        let to_c = source("b", false).after(Some(to_b), schema(1));
        assert_eq!(to_c.result_goes_to().unwrap().agent, "a");
        assert_eq!(to_c.returned_schema(), schema(1).as_ref());
        let to_d = source("c", true).after(Some(to_c), schema(2));
        let mut released = to_d.clone();
        let agents: Vec<_> = released
            .release_waiting()
            .unwrap()
            .into_iter()
            .map(|(agent, _)| agent)
            .collect();
        assert_eq!(agents, ["c", "a"], "b asked for nothing back");
        assert_eq!(released.release_waiting(), None, "released once");
        assert_eq!(to_d.result_goes_to().unwrap().agent, "c");
        assert_eq!(to_d.returned_schema(), None, "d's schema is the record's");
        // d's result went to c: a waits next, with its schema.
        let next = to_d.after_return().unwrap();
        assert_eq!(next.agent, "a");
        assert_eq!(next.return_schema, schema(1));
        assert_eq!(next.returned_schema(), schema(1).as_ref());
        assert!(next.waiting.is_empty());
        assert_eq!(next.after_return(), None);
    }

    #[tokio::test]
    async fn a_write_is_read_with_its_task_json_until_a_later_set_is_applied() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_working_task(paused(dir.path()), "t1").await;
        let overlay = |task_id| match ledger.get_for_reply(task_id).unwrap() {
            Some(ReplyTask::Read(read)) => read,
            other => panic!("{task_id} not read from the overlay: {other:?}"),
        };
        let read = overlay("t1");
        let task_json = read.task_json.clone().expect("the write's task JSON");
        assert_eq!(
            task_json.get(),
            serde_json::to_string(&read.record.task).unwrap()
        );
        // The set applied last keeps both.
        ledger.applier.apply_pending().unwrap();
        let applied = overlay("t1");
        assert!(Arc::ptr_eq(&applied.record, &read.record));
        assert!(Arc::ptr_eq(&applied.task_json.unwrap(), &task_json));
        // A newer write's JSON comes before the applied one's.
        flip(&ledger, "t1", 1).await;
        let newer = overlay("t1");
        assert_eq!(newer.record.version, read.record.version + 1);
        assert_eq!(
            newer.task_json.unwrap().get(),
            serde_json::to_string(&newer.record.task).unwrap()
        );
        // Read from sled: the record's bytes, not decoded.
        ledger.applier.apply_pending().unwrap();
        ledger.create(record("t2"), vec![]).await.unwrap();
        ledger.applier.apply_pending().unwrap();
        let Some(ReplyTask::Stored(stored)) = ledger.get_for_reply("t1").unwrap() else {
            panic!("t1 not read from sled");
        };
        assert_eq!(
            serde_json::to_string(&stored.task_json().unwrap().view(None, true)).unwrap(),
            serde_json::to_string(&newer.record.task).unwrap()
        );
        let stored = ReplyTask::Stored(stored);
        assert_eq!(stored.owner().unwrap(), newer.record.owner);
        assert_eq!(ledger.get("t1").unwrap().as_ref(), Some(&*newer.record));
        assert!(ledger.get_for_reply("missing").unwrap().is_none());
    }

    #[tokio::test]
    async fn the_log_figures_count_one_sync_for_a_group_of_writes() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Arc::new(Ledger::open(dir.path()).unwrap());
        ledger.create(record("t0"), vec![]).await.unwrap();
        let before = ledger.log_figures();
        assert_eq!(before.durable_writes, 1);
        assert!(before.syncs >= 1, "{before:?}");

        // Three writes noted while the log is held become durable together.
        let hold = ledger.hold_log();
        let writers: Vec<_> = ["t1", "t2", "t3"]
            .into_iter()
            .map(|task_id| {
                let ledger = ledger.clone();
                tokio::spawn(async move { ledger.create(record(task_id), vec![]).await })
            })
            .collect();
        let noted = async {
            while ledger.flusher.latest_ticket() < 4 {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(5), noted)
            .await
            .expect("three writes noted");
        assert_eq!(ledger.log_figures(), before, "nothing durable while held");
        drop(hold);
        for writer in writers {
            writer.await.unwrap().unwrap();
        }
        let after = ledger.log_figures();
        assert_eq!(after.durable_writes, 4);
        assert_eq!(after.syncs, before.syncs + 1, "one sync for the group");
    }

    /// A log that cannot append holds the writes noted meanwhile, says so
    /// until an append succeeds, and loses none of them.
    #[tokio::test]
    async fn a_failing_log_holds_its_writes_and_reports_until_an_append_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Arc::new(Ledger::open(dir.path()).unwrap());
        ledger.create(record("t0"), vec![]).await.unwrap();
        assert!(ledger.log_failure().is_none());
        let before = ledger.log_figures();

        let fault = ledger.fail_log(std::io::ErrorKind::StorageFull);
        let writer = tokio::spawn({
            let ledger = ledger.clone();
            async move { ledger.create(record("t1"), vec![]).await }
        });
        let failure = ledger.until_log_fails().await;
        assert!(failure.attempts >= 1, "{failure:?}");
        assert!(failure.error.contains("injected by a test"), "{failure:?}");
        let text = failure.to_string();
        assert!(text.contains("cannot make writes durable"), "{text}");
        let during = ledger.log_figures();
        assert_eq!(
            during.durable_writes, before.durable_writes,
            "nothing durable"
        );
        assert!(during.failed_appends >= 1, "{during:?}");
        assert!(!writer.is_finished(), "the write waits for the log");

        drop(fault);
        tokio::time::timeout(std::time::Duration::from_secs(5), writer)
            .await
            .expect("the write is durable once the log appends")
            .unwrap()
            .unwrap();
        assert!(ledger.log_failure().is_none(), "recovered");
        assert_eq!(ledger.log_figures().durable_writes, 2);

        ledger.close();
        drop(ledger);
        let reopened = reopen(dir.path());
        assert!(
            reopened.get("t1").unwrap().is_some(),
            "kept across a restart"
        );
        reopened.close();
    }

    /// A failed application is recorded wherever it happens and cleared by
    /// the next that succeeds, even a listing's: the applier thread, which
    /// finds nothing left to apply then, must not leave it recorded.
    #[tokio::test]
    async fn an_application_by_a_listing_ends_the_failure_it_follows() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = paused(dir.path());
        let fault = ledger.fail_sled(std::io::ErrorKind::Other);
        ledger
            .put_raw(b"probe".to_vec(), b"1".to_vec())
            .await
            .unwrap();
        let err = ledger.applier.apply_pending().unwrap_err();
        assert!(matches!(err, LedgerError::Unavailable(_)), "{err:?}");
        assert!(
            err.to_string().contains("cannot apply writes to sled"),
            "{err}"
        );
        assert!(ledger.sled_failure().is_some());

        drop(fault);
        drop(ledger.applier.applied().expect("applied by the listing"));
        assert!(ledger.sled_failure().is_none(), "cleared");
        ledger.close();
    }

    /// A checkpoint that cannot flush sled keeps the log segments it was
    /// given and says so until one succeeds, which then deletes them.
    #[tokio::test]
    async fn a_failing_checkpoint_keeps_the_log_and_reports_until_one_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        let fault = ledger.fail_sled(std::io::ErrorKind::Other);
        // A full segment as the flusher retires it, empty for the test.
        let segment = dir.path().join("wal").join("retired-by-test");
        std::fs::write(&segment, b"").unwrap();
        ledger.applier.retire(segment.clone());

        let failure = ledger.until_sled_fails().await;
        let text = failure.to_string();
        assert!(text.contains("cannot checkpoint sled"), "{text}");
        assert!(segment.exists(), "kept while sled cannot flush");
        assert!(ledger.sled_failed_attempts() >= 1);

        drop(fault);
        until("sled works again", || {
            ledger.sled_failure().is_none().then_some(())
        })
        .await;
        // The checkpoint clears the failure once it has deleted the segment.
        assert!(!segment.exists(), "deleted once sled holds its writes");
        ledger.close();
    }

    /// What a restart owes push configs: a new config only its task's
    /// events after it; a config the task's events past its mark, until
    /// they are handled; nothing once the task's end was handled, nor to a
    /// deleted config.
    #[tokio::test]
    async fn a_restart_owes_push_configs_the_events_never_handled() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_working_task(Ledger::open(dir.path()).unwrap(), "t1").await;
        let config = |task_id: &str, id: &str| TaskPushNotificationConfig {
            id: id.into(),
            task_id: task_id.into(),
            url: "https://hooks.example.com/baton".into(),
            ..TaskPushNotificationConfig::default()
        };
        for id in ["c1", "c2"] {
            ledger
                .put_push_config(&config("t1", id), 10)
                .await
                .unwrap()
                .unwrap();
        }
        let owed = |ledger: &Ledger| ledger.push_backlog().unwrap();
        let to = |task_id: &str, ids: &[&str]| {
            (
                task_id.to_string(),
                ids.iter().map(|id| id.to_string()).collect::<Vec<_>>(),
            )
        };
        let mark = |through, task_ended| PushMark {
            through,
            task_ended,
        };
        assert_eq!(owed(&ledger), [], "no event since the configs");

        flip(&ledger, "t1", 1).await;
        let last = ledger.get("t1").unwrap().unwrap().last_seq;
        assert_eq!(owed(&ledger), [to("t1", &["c1", "c2"])]);
        ledger
            .note_push_handled("t1", "c2", mark(last, false))
            .unwrap();
        assert_eq!(owed(&ledger), [to("t1", &["c1"])]);
        ledger
            .note_push_handled("t1", "c2", mark(1, false))
            .unwrap();
        assert_eq!(
            owed(&ledger),
            [to("t1", &["c1"])],
            "a mark never moves back"
        );

        let done = status("t1", TaskState::Completed);
        ledger
            .update("t1", |_| Ok::<_, LedgerError>(vec![done]))
            .await
            .unwrap();
        let ended = ledger.get("t1").unwrap().unwrap().last_seq;
        ledger
            .note_push_handled("t1", "c1", mark(ended, true))
            .unwrap();
        // A config for a task its send has yet to create is owed its first event.
        ledger
            .put_push_config(&config("t2", "c1"), 10)
            .await
            .unwrap()
            .unwrap();
        let working = status("t2", TaskState::Working);
        ledger.create(record("t2"), vec![working]).await.unwrap();
        ledger.close();
        drop(ledger);

        let ledger = Ledger::open(dir.path()).unwrap();
        assert_eq!(owed(&ledger), [to("t1", &["c2"]), to("t2", &["c1"])]);
        ledger.delete_push_config("t1", "c2").await.unwrap();
        assert_eq!(ledger.read_raw(&keys::push_mark("t1", "c2")).unwrap(), None);
        ledger
            .note_push_handled("t1", "c2", mark(ended, true))
            .unwrap();
        assert_eq!(
            ledger.read_raw(&keys::push_mark("t1", "c2")).unwrap(),
            None,
            "deleted"
        );
        ledger
            .put_push_config(&config("t1", "c3"), 10)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            owed(&ledger),
            [to("t2", &["c1"])],
            "a new config on an ended task"
        );
        ledger.close();
    }

    /// A push config is read only once the write that made what the read
    /// sees (its create, or its delete) is durable: until then the read
    /// waits, so no reader is shown what a crash could take back.
    #[tokio::test]
    async fn push_config_reads_wait_for_the_writes_they_see() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Arc::new(Ledger::open(dir.path()).unwrap());
        let config = TaskPushNotificationConfig {
            id: "c1".into(),
            task_id: "t1".into(),
            url: "https://hooks.example.com/baton".into(),
            ..TaskPushNotificationConfig::default()
        };
        let key = keys::push_config("t1", "c1");
        async fn still_waiting(read: impl std::future::Future) -> bool {
            let waited = std::time::Duration::from_millis(100);
            tokio::time::timeout(waited, read).await.is_err()
        }

        let hold = ledger.hold_log();
        let create = tokio::spawn({
            let (ledger, config) = (ledger.clone(), config.clone());
            async move { ledger.put_push_config(&config, 10).await }
        });
        until("the create is noted", || ledger.applier.raw(&key)).await;
        let get = ledger.get_push_config("t1", "c1");
        let list = ledger.push_configs("t1");
        tokio::pin!(get, list);
        assert!(
            still_waiting(&mut get).await,
            "GetTaskPushNotificationConfig"
        );
        assert!(still_waiting(&mut list).await, "the list");
        drop(hold);
        assert_eq!(get.await.unwrap(), Some(config.clone()));
        assert_eq!(list.await.unwrap(), [config]);
        create.await.unwrap().unwrap().unwrap();

        let hold = ledger.hold_log();
        let delete = tokio::spawn({
            let ledger = ledger.clone();
            async move { ledger.delete_push_config("t1", "c1").await }
        });
        until("the delete is noted", || {
            ledger
                .applier
                .raw(&key)
                .filter(|write| write.value.is_none())
        })
        .await;
        let get = ledger.get_push_config("t1", "c1");
        tokio::pin!(get);
        assert!(still_waiting(&mut get).await, "a read of the delete");
        drop(hold);
        assert_eq!(get.await.unwrap(), None);
        delete.await.unwrap().unwrap();
        ledger.close();
    }

    /// Segments retired while an application fails are still deleted
    /// oldest first: the one the failed application held goes back ahead
    /// of those retired meanwhile. A later one deleted first would leave
    /// the older to replay its raw writes over newer values after a crash.
    #[tokio::test]
    async fn segments_retired_while_an_application_fails_stay_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        let wal_dir = dir.path().join("wal");
        // The older cannot be deleted (a directory with a file in it), so
        // a checkpoint keeps it, and every segment after it.
        let older = wal_dir.join("older-by-test");
        std::fs::create_dir(&older).unwrap();
        std::fs::write(older.join("kept"), b"").unwrap();
        let newer = wal_dir.join("newer-by-test");
        std::fs::write(&newer, b"").unwrap();

        let fault = ledger.fail_sled(std::io::ErrorKind::Other);
        ledger.create(record("t0"), vec![]).await.unwrap();
        ledger.applier.retire(older.clone());
        // From the second failed application on, the applier holds the
        // older segment while it fails (it takes them before applying).
        ledger.until_sled_fails().await;
        until("a second failed application", || {
            (ledger.sled_failed_attempts() >= 2).then_some(())
        })
        .await;
        ledger.applier.retire(newer.clone());
        drop(fault);

        until("sled works again", || {
            ledger.sled_failure().is_none().then_some(())
        })
        .await;
        let kept = until("the checkpoint keeps what it cannot delete", || {
            Some(ledger.applier.retired_segments()).filter(|kept| !kept.is_empty())
        })
        .await;
        assert_eq!(kept, [older, newer.clone()], "oldest first");
        assert!(newer.exists(), "not deleted ahead of the older one");
        ledger.close();
    }

    /// A stop does not hang on a log that cannot append: it gives up on
    /// the writes still waiting, which were never reported durable, and
    /// the ledger opens again with everything that was.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stop_gives_up_on_a_log_that_cannot_append() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Arc::new(Ledger::open(dir.path()).unwrap());
        ledger.create(record("t0"), vec![]).await.unwrap();
        let _fault = ledger.fail_log(std::io::ErrorKind::StorageFull);
        let writer = tokio::spawn({
            let ledger = ledger.clone();
            async move { ledger.create(record("t1"), vec![]).await }
        });
        ledger.until_log_fails().await;

        let closing = tokio::task::spawn_blocking({
            let ledger = ledger.clone();
            move || ledger.close()
        });
        tokio::time::timeout(std::time::Duration::from_secs(20), closing)
            .await
            .expect("the stop ends")
            .unwrap();
        assert!(
            !writer.is_finished(),
            "the write was never reported durable"
        );
        writer.abort();
        let _ = writer.await;
        drop(ledger);

        let reopened = reopen(dir.path());
        assert!(
            reopened.get("t0").unwrap().is_some(),
            "durable before the fault"
        );
        assert!(reopened.get("t1").unwrap().is_none(), "never durable");
        reopened.close();
    }

    /// A snapshot sled could not finish (a full disk) sorts as its newest,
    /// which sled then refuses as corrupt; the ledger removes it and opens.
    #[tokio::test]
    async fn an_unfinished_sled_snapshot_does_not_stop_the_ledger_opening() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        ledger.create(record("t1"), vec![]).await.unwrap();
        ledger.close();
        drop(ledger);
        let unfinished = dir.path().join("snap.FFFFFFFFFFFFFFFF.generating");
        std::fs::write(&unfinished, b"").unwrap();
        let refused = sled::Config::new().path(dir.path()).open();
        assert!(
            matches!(refused, Err(sled::Error::Corruption { .. })),
            "sled alone refuses it: {refused:?}"
        );

        let reopened = reopen(dir.path());
        assert!(reopened.get("t1").unwrap().is_some());
        assert!(!unfinished.exists());
        reopened.close();
    }

    #[tokio::test]
    async fn an_unchanged_update_logs_nothing_and_returns_the_record_as_read() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_working_task(paused(dir.path()), "t1").await;
        let written = ledger.flusher.latest_ticket();

        // Even a closure that edits its copy leaves the record as it was.
        let read = ledger
            .update("t1", |record| {
                record.agent = "edited".into();
                Ok::<_, LedgerError>(Change::Unchanged)
            })
            .await
            .unwrap();
        assert_eq!((read.version, read.last_seq), (1, 1));
        assert_eq!(read.agent, "agent");
        assert_eq!(ledger.flusher.latest_ticket(), written);

        // An update without events that did change the record is logged.
        let made = ledger
            .update("t1", |record| {
                record.agent = "other".into();
                Ok::<_, LedgerError>(Vec::new())
            })
            .await
            .unwrap();
        assert_eq!((made.version, made.agent.as_str()), (2, "other"));
        assert_eq!(ledger.flusher.latest_ticket(), written + 1);
    }

    #[tokio::test]
    async fn an_update_past_the_record_limit_logs_nothing_and_says_how_long_it_would_be() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_working_task(paused(dir.path()), "t1").await;
        let before = ledger.get("t1").unwrap().unwrap();
        let written = ledger.flusher.latest_ticket();
        let grow = |record: &mut TaskRecord| {
            record.agent = "a".repeat(2000);
            Ok::<_, LedgerError>(Vec::new())
        };
        let err = ledger
            .update_within("t1", bytes_limit(1500), grow)
            .await
            .unwrap_err();
        assert_eq!(err.passed_limit(), Some(TaskLimit::Bytes));
        let LedgerError::RecordTooLarge { bytes, limit } = err else {
            panic!("{err:?}");
        };
        assert!(bytes > 2000, "{bytes}");
        assert_eq!(limit, 1500);
        assert_eq!(ledger.flusher.latest_ticket(), written);
        assert_eq!(ledger.get("t1").unwrap().unwrap(), before);

        // Within the limit the same change is written.
        let made = ledger
            .update_within("t1", bytes_limit(bytes), grow)
            .await
            .unwrap();
        assert_eq!(made.version, before.version + 1);
        assert_eq!(ledger.flusher.latest_ticket(), written + 1);
    }

    /// A 1 KiB chunk of artifact `a1`, as an agent streams its answer.
    fn chunk(task_id: &str, first: bool) -> StreamResponse {
        StreamResponse::ArtifactUpdate(crate::protocol::TaskArtifactUpdateEvent {
            task_id: task_id.to_string(),
            context_id: "ctx".into(),
            artifact: crate::protocol::Artifact {
                artifact_id: "a1".into(),
                parts: vec![crate::protocol::Part::text("x".repeat(1024))],
                ..Default::default()
            },
            append: !first,
            ..Default::default()
        })
    }

    /// Writes `events` to `task_id`, within `limits`.
    async fn write(
        ledger: &Ledger,
        task_id: &str,
        limits: TaskLimits,
        events: Vec<StreamResponse>,
    ) -> Result<Arc<TaskRecord>, LedgerError> {
        ledger
            .update_within(task_id, limits, |_| Ok::<_, LedgerError>(events))
            .await
    }

    /// Bytes of frames in the log's segments, each zero-filled after them.
    fn logged_bytes(dir: &Path) -> usize {
        let segments = wal::segments(&dir.join("wal")).unwrap();
        let frames_len =
            |bytes: Vec<u8>| bytes.iter().rposition(|&b| b != 0).map_or(0, |at| at + 1);
        segments
            .into_iter()
            .map(|(_, path)| frames_len(std::fs::read(path).unwrap()))
            .sum()
    }

    /// `ledger` after creating one WORKING task in it, with an artifact of
    /// 24 chunks: a record of about 25 KiB.
    async fn with_large_task(ledger: Ledger, task_id: &str) -> Ledger {
        let ledger = with_working_task(ledger, task_id).await;
        add_chunks(&ledger, task_id, 0..24).await;
        ledger
    }

    /// Writes chunks `numbers` of artifact `a1` to `task_id`, one write
    /// each; chunk 0 starts the artifact.
    async fn add_chunks(ledger: &Ledger, task_id: &str, numbers: std::ops::Range<usize>) {
        for n in numbers {
            let chunk = vec![chunk(task_id, n == 0)];
            write(ledger, task_id, TaskLimits::NONE, chunk)
                .await
                .unwrap();
        }
    }

    #[tokio::test]
    async fn a_large_records_writes_log_what_they_add_and_replay_whole() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_large_task(paused(dir.path()), "t1").await;
        // sled holds the task as it is now; the log holds every write.
        ledger.applier.apply_pending().unwrap();
        let from = logged_bytes(dir.path());
        for i in 24..64 {
            let mut events = vec![chunk("t1", false)];
            // Now and then a status message joins the history.
            if i % 10 == 0 {
                let message = crate::protocol::Message {
                    message_id: format!("m{i}"),
                    parts: vec![crate::protocol::Part::text("working on it")],
                    ..Default::default()
                };
                let mut update = status("t1", TaskState::Working);
                if let StreamResponse::StatusUpdate(update) = &mut update {
                    update.status.message = Some(message);
                }
                events.push(update);
            }
            write(&ledger, "t1", TaskLimits::NONE, events)
                .await
                .unwrap();
        }
        // Whole records would have been forty of 25–65 KiB each.
        let logged = logged_bytes(dir.path()) - from;
        assert!(
            logged < 40 * 3 * 1024,
            "{logged} bytes logged for forty 1 KiB chunks"
        );
        let written = ledger.get("t1").unwrap().unwrap();
        assert_eq!(written.task.artifacts[0].parts.len(), 64);
        assert_eq!(written.task.history.len(), 4);
        ledger.close();
        drop(ledger);

        // Rebuilt from the log at start-up, on the log's own whole writes
        // (the log still holds the task's creation; sled's record is the
        // subject of the next test).
        let ledger = reopen(dir.path());
        assert_eq!(ledger.get("t1").unwrap().as_ref(), Some(&written));
        // Written on after the restart (a replayed record's first write is
        // logged whole), and replayed again.
        let before = ledger.flusher.latest_ticket();
        add_chunks(&ledger, "t1", 64..66).await;
        assert_eq!(ledger.flusher.latest_ticket(), before + 2);
        let written = ledger.get("t1").unwrap().unwrap();
        ledger.close();
        drop(ledger);
        let ledger = reopen(dir.path());
        assert_eq!(ledger.get("t1").unwrap().as_ref(), Some(&written));
        ledger.close();
    }

    /// The ledger in `dir`, just closed in this process, opened again with
    /// its applier paused.
    fn reopen_paused(dir: &Path) -> Ledger {
        while_locked(|| Ledger::open_with_applier_paused(dir), ledger_locked).unwrap()
    }

    /// `task_id`, made large and checkpointed into sled by a clean close,
    /// then written `chunks` chunks more, which only the log holds.
    async fn large_task_with_chunks_in_the_log(dir: &Path, task_id: &str, chunks: usize) -> Ledger {
        let ledger = with_large_task(Ledger::open(dir).unwrap(), task_id).await;
        ledger.close();
        drop(ledger);
        let ledger = reopen_paused(dir);
        add_chunks(&ledger, task_id, 24..24 + chunks).await;
        ledger
    }

    #[tokio::test]
    async fn writes_after_a_restart_log_what_they_add_and_replay_on_sleds_record() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = large_task_with_chunks_in_the_log(dir.path(), "t1", 8).await;
        // The first too: the record read from sled came with its length.
        let logged = logged_bytes(dir.path());
        assert!(
            logged < 8 * 3 * 1024,
            "{logged} bytes logged for eight 1 KiB chunks"
        );
        let written = ledger.get("t1").unwrap().unwrap();
        ledger.close();
        drop(ledger);

        let ledger = reopen(dir.path());
        assert_eq!(ledger.get("t1").unwrap().as_ref(), Some(&written));
        // Their events came back with them: one WORKING, 24 chunks, 8 more.
        let page = ledger.durable_events_after("t1", 25).await.unwrap();
        let seqs: Vec<u64> = page.events.iter().map(|event| event.seq).collect();
        assert_eq!(seqs, (26..=33).collect::<Vec<_>>());
        ledger.close();
    }

    /// A record an older build stored otherwise (here with whitespace; in
    /// fact with nanosecond timestamps) is counted, not measured by its
    /// stored bytes, before its first write is logged as what it adds.
    #[tokio::test]
    async fn a_record_stored_longer_than_its_encoding_is_counted_before_additions() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_large_task(Ledger::open(dir.path()).unwrap(), "t1").await;
        ledger.close();
        drop(ledger);
        {
            let (_db, tree) = raw_tree(dir.path());
            let stored = tree.get(keys::task("t1")).unwrap().unwrap();
            let value: serde_json::Value = serde_json::from_slice(&stored).unwrap();
            let pretty = serde_json::to_vec_pretty(&value).unwrap();
            assert!(pretty.len() > stored.len());
            tree.insert(keys::task("t1"), pretty).unwrap();
            tree.flush().unwrap();
        }
        let ledger = reopen_paused(dir.path());
        let grown = ledger.get("t1").unwrap().unwrap();
        let whole = serde_json::to_vec(&grown).unwrap().len();
        // Exactly one chunk more than the record's encoding is taken.
        let chunk = vec![chunk("t1", false)];
        let made = write(&ledger, "t1", TaskLimits::NONE, chunk).await.unwrap();
        let added = serde_json::to_vec(&*made).unwrap().len();
        assert_eq!(made.logged_len.total, added);
        assert!(added - whole < 1100, "{whole} then {added}");
        let logged = logged_bytes(dir.path());
        assert!(logged < 3 * 1024, "{logged} bytes logged for a 1 KiB chunk");
        ledger.close();
        drop(ledger);
        let ledger = reopen(dir.path());
        assert_eq!(ledger.get("t1").unwrap().as_ref(), Some(&*made));
        ledger.close();
    }

    #[tokio::test]
    async fn additions_to_a_record_that_does_not_decode_are_kept_not_replayed() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = large_task_with_chunks_in_the_log(dir.path(), "t1", 2).await;
        ledger.create(record("t2"), vec![]).await.unwrap();
        ledger.damage_record("t1");
        ledger.close();
        drop(ledger);

        // Start-up goes on, the task left as it is and the log kept.
        let ledger = reopen(dir.path());
        assert!(ledger.get("t1").is_err_and(|err| err.is_corrupt()));
        assert!(ledger.get("t2").unwrap().is_some());
        let damaged = std::fs::read_dir(dir.path().join("wal").join("damaged")).unwrap();
        let kept: Vec<_> = damaged
            .flat_map(|folder| std::fs::read_dir(folder.unwrap().path()).unwrap())
            .collect();
        assert_eq!(kept.len(), 1, "the replayed segment");
        ledger.close();
    }

    #[tokio::test]
    async fn a_write_logged_as_its_additions_is_held_to_the_whole_records_length() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_large_task(paused(dir.path()), "t1").await;
        let before = ledger.get("t1").unwrap().unwrap();
        let written = ledger.flusher.latest_ticket();
        // A chunk more than the record's length before.
        let limit = bytes_limit(before.logged_len.total + 1000);
        let refused = write(&ledger, "t1", limit, vec![chunk("t1", false)]).await;
        let Err(LedgerError::RecordTooLarge { bytes, .. }) = refused else {
            panic!("the write was not refused for its length");
        };
        assert_eq!(ledger.flusher.latest_ticket(), written);
        assert_eq!(ledger.get("t1").unwrap().unwrap(), before);
        // At exactly that length, the write is taken, and it is that long.
        let made = write(&ledger, "t1", bytes_limit(bytes), vec![chunk("t1", false)])
            .await
            .unwrap();
        assert_eq!(serde_json::to_vec(&*made).unwrap().len(), bytes);
        ledger.close();
    }

    #[tokio::test]
    async fn an_idempotency_claim_is_released_only_as_it_was_read() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = paused(dir.path());
        let claim = |task_id: &str| IdempotencyRecord {
            fingerprint: "f".into(),
            task_id: task_id.into(),
            message: None,
            claimed_by: 7,
            history_from: None,
            claim_number: 0,
        };
        assert!(
            ledger
                .claim_idempotency("o", "k", &claim("t1"))
                .await
                .unwrap()
                .is_none()
        );
        // Read as t0's, the claim is another's by now: it stays.
        assert!(
            !ledger
                .release_idempotency_if("o", "k", &claim("t0"))
                .await
                .unwrap()
        );
        assert_eq!(
            ledger.claim_idempotency_peek("o", "k").unwrap(),
            Some(claim("t1"))
        );
        assert!(
            ledger
                .release_idempotency_if("o", "k", &claim("t1"))
                .await
                .unwrap()
        );
        assert_eq!(ledger.claim_idempotency_peek("o", "k").unwrap(), None);
        assert!(
            !ledger
                .release_idempotency_if("o", "k", &claim("t1"))
                .await
                .unwrap()
        );
    }

    #[tokio::test]
    async fn an_update_past_the_event_limit_logs_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_working_task(paused(dir.path()), "t1").await;
        let limits = TaskLimits {
            max_events: 3,
            ..TaskLimits::NONE
        };
        let flips = |count: usize| {
            move |record: &mut TaskRecord| {
                let states = [TaskState::InputRequired, TaskState::Working];
                let events = (0..count)
                    .map(|n| status(&record.task.id, states[n % 2]))
                    .collect::<Vec<_>>();
                Ok::<_, LedgerError>(events)
            }
        };
        let before = ledger.get("t1").unwrap().unwrap();
        let written = ledger.flusher.latest_ticket();
        let err = ledger
            .update_within("t1", limits, flips(3))
            .await
            .unwrap_err();
        assert_eq!(err.passed_limit(), Some(TaskLimit::Events));
        let LedgerError::TooManyEvents { events, limit } = err else {
            panic!("{err:?}");
        };
        assert_eq!((events, limit), (4, 3));
        assert_eq!(ledger.flusher.latest_ticket(), written);
        assert_eq!(ledger.get("t1").unwrap().unwrap(), before);

        // Up to the limit is written.
        let made = ledger.update_within("t1", limits, flips(2)).await.unwrap();
        assert_eq!(made.last_seq, 3);
        let err = ledger.update_within("t1", limits, flips(1)).await;
        assert!(matches!(err, Err(LedgerError::TooManyEvents { .. })));
        // Past it (by an unbounded write), a write of no event still is.
        ledger.update("t1", flips(1)).await.unwrap();
        let renamed = |record: &mut TaskRecord| {
            record.agent = "renamed".into();
            Ok::<_, LedgerError>(Vec::new())
        };
        let made = ledger.update_within("t1", limits, renamed).await.unwrap();
        assert_eq!((made.last_seq, made.agent.as_str()), (4, "renamed"));
    }

    /// Limits of `max_bytes` alone.
    fn bytes_limit(max_bytes: usize) -> TaskLimits {
        TaskLimits {
            max_bytes,
            ..TaskLimits::NONE
        }
    }

    #[tokio::test]
    async fn a_create_past_the_record_limit_writes_its_first_event_alone() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = paused(dir.path());
        let events = |task_id: &str| {
            let text = crate::protocol::Part::text("x".repeat(2000));
            let long = crate::protocol::Message::agent(vec![text]);
            let asking = StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                task_id: task_id.into(),
                context_id: "ctx".into(),
                status: TaskStatus::now(TaskState::InputRequired, Some(long)),
                ..TaskStatusUpdateEvent::default()
            });
            vec![status(task_id, TaskState::Working), asking]
        };
        // The hop's end, as the gateway notes it from the events.
        let mut ended = record("t1");
        ended.hops.push(HopRecord {
            ended_at: Some(Utc::now()),
            state: Some(TaskState::InputRequired),
            reason: Some("ASKED".into()),
            ..HopRecord::default()
        });
        let created = ledger
            .create_within(ended, events("t1"), bytes_limit(1500))
            .await
            .unwrap();
        assert_eq!(created.cut, Some(TaskLimit::Bytes));
        let hop = &created.record.hops[0];
        assert_eq!(
            (hop.ended_at, hop.state, hop.reason.as_deref()),
            (None, None, None)
        );
        let read = ledger.get("t1").unwrap().unwrap();
        assert_eq!(read.task.status.state, TaskState::Working);
        assert_eq!((read.version, read.last_seq), (1, 1));
        assert_eq!(read.agent, record("t1").agent);
        assert_eq!(*created.record, read);

        // Past the event limit the same.
        let one_event = TaskLimits {
            max_events: 1,
            ..TaskLimits::NONE
        };
        let created = ledger
            .create_within(record("t3"), events("t3"), one_event)
            .await
            .unwrap();
        assert_eq!(created.cut, Some(TaskLimit::Events));
        assert_eq!(created.record.last_seq, 1);

        // Within both every event is written.
        let limits = TaskLimits {
            max_events: 2,
            ..TaskLimits::NONE
        };
        let created = ledger
            .create_within(record("t2"), events("t2"), limits)
            .await
            .unwrap();
        assert_eq!(created.cut, None);
        assert_eq!(created.record.last_seq, 2);
    }

    #[tokio::test]
    async fn events_read_back_in_order_across_applied_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_working_task(paused(dir.path()), "t1").await;
        flip(&ledger, "t1", 3).await;
        ledger.applier.apply_pending().unwrap(); // one chunk of 4
        flip(&ledger, "t1", 3).await; // pending, not yet applied

        let seqs = |events: Vec<LedgerEvent>| events.iter().map(|e| e.seq).collect::<Vec<_>>();
        assert_eq!(
            seqs(ledger.events_after("t1", 0).unwrap().0.events),
            (1..=7).collect::<Vec<_>>()
        );
        assert_eq!(
            seqs(ledger.events_after("t1", 2).unwrap().0.events),
            vec![3, 4, 5, 6, 7]
        );
        assert_eq!(
            seqs(ledger.events_after("t1", 5).unwrap().0.events),
            vec![6, 7]
        );
        assert!(ledger.events_after("t1", 7).unwrap().0.events.is_empty());
        let record = ledger.get("t1").unwrap().unwrap();
        assert_eq!((record.version, record.last_seq), (7, 7));
        assert_eq!(record.task.status.state, TaskState::InputRequired);
    }

    #[tokio::test]
    async fn a_replay_reads_a_page_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_working_task(paused(dir.path()), "t1").await;
        // Chunks of 100 events each: pages end within them.
        for _ in 0..5 {
            flip(&ledger, "t1", 100).await;
            ledger.applier.apply_pending().unwrap();
        }
        let seqs = |page: &ReplayPage| page.events.iter().map(|e| e.seq).collect::<Vec<_>>();
        let page = ledger.events_after("t1", 0).unwrap().0;
        assert!(page.more);
        assert_eq!(seqs(&page), (1..=256).collect::<Vec<_>>());
        let page = ledger.events_after("t1", 256).unwrap().0;
        assert!(!page.more);
        assert_eq!(seqs(&page), (257..=501).collect::<Vec<_>>());

        // Large events: the page stops once a mebibyte is read.
        let big = "x".repeat(200 * 1024);
        for i in 0..10 {
            let event = StreamResponse::ArtifactUpdate(crate::protocol::TaskArtifactUpdateEvent {
                task_id: "t1".into(),
                artifact: crate::protocol::Artifact {
                    artifact_id: format!("a{i}"),
                    parts: vec![crate::protocol::Part::text(big.clone())],
                    ..Default::default()
                },
                ..Default::default()
            });
            ledger
                .update("t1", |_| Ok::<_, LedgerError>(vec![event]))
                .await
                .unwrap();
            ledger.applier.apply_pending().unwrap();
        }
        let page = ledger.events_after("t1", 501).unwrap().0;
        assert!(page.more);
        assert_eq!(
            seqs(&page),
            (502..=507).collect::<Vec<_>>(),
            "until past 1 MiB"
        );
    }

    #[tokio::test]
    async fn a_stream_behind_an_ended_task_replays_up_to_its_final_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_working_task(paused(dir.path()), "t1").await;
        ledger.applier.apply_pending().unwrap(); // event 1 logged while WORKING
        flip(&ledger, "t1", 1).await;
        let done = status("t1", TaskState::Completed);
        ledger
            .update("t1", |_| Ok::<_, LedgerError>(vec![done]))
            .await
            .unwrap();

        let events = ledger.events_after("t1", 0).unwrap().0.events;
        let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
        assert_eq!(
            seqs,
            vec![1, 3],
            "the logged event, then the final snapshot"
        );
        match &events[1].event {
            StreamResponse::Task(task) => assert_eq!(task.status.state, TaskState::Completed),
            other => panic!("expected the final snapshot, got {other:?}"),
        }
        assert_eq!(ledger.events_after("t1", 1).unwrap().0.events.len(), 1);
        assert!(ledger.events_after("t1", 3).unwrap().0.events.is_empty());
    }

    #[tokio::test]
    async fn a_set_larger_than_one_intent_is_applied_whole() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = paused(dir.path());
        let ids: Vec<String> = (0..300).map(|i| format!("t{i:03}")).collect();
        for id in &ids {
            ledger
                .create(record(id), vec![status(id, TaskState::Working)])
                .await
                .unwrap();
        }
        ledger.applier.apply_pending().unwrap();
        // Applied in chunks, each under its own intent; none is left behind.
        let intent = ledger.tree.get(keys::applying()).unwrap();
        assert_eq!(intent.as_deref(), Some(&[][..]));
        let query = ListQuery {
            page_size: 100,
            ..ListQuery::default()
        };
        let all = ledger.list("owner", &query).unwrap();
        assert_eq!(all.total_size, 300);
        assert_eq!(all.records.len(), 100);
        assert_eq!(ledger.active_task_ids().unwrap().len(), 300);
    }

    #[tokio::test]
    async fn indexes_and_counters_follow_coalesced_writes() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = paused(dir.path());
        for id in ["a", "b", "c"] {
            ledger
                .create(record(id), vec![status(id, TaskState::Working)])
                .await
                .unwrap();
        }
        // Several writes to one task before any application, its last status
        // a millisecond after the others' (timestamps are kept to the ms, and
        // three creates can fit in one).
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        flip(&ledger, "b", 5).await;
        let query = |state| ListQuery {
            state,
            page_size: 10,
            ..ListQuery::default()
        };
        let waiting = ledger
            .list("owner", &query(Some(TaskState::InputRequired)))
            .unwrap();
        assert_eq!(waiting.total_size, 1);
        let first = |page: ListPage| decoded(page.records.into_iter().next().unwrap());
        assert_eq!(first(waiting).task.id, "b");
        let working = ledger
            .list("owner", &query(Some(TaskState::Working)))
            .unwrap();
        assert_eq!(working.total_size, 2);
        let all = ledger.list("owner", &query(None)).unwrap();
        assert_eq!(all.total_size, 3);
        assert_eq!(first(all).task.id, "b", "newest status first");
        assert_eq!(ledger.waiting_task_ids().unwrap(), vec!["b".to_string()]);
        assert_eq!(ledger.active_task_ids().unwrap().len(), 2);
    }

    /// Runs `open` until it does not fail on a lock: sled's IO threads may
    /// hold the directory's lock for a moment after its last handle is
    /// dropped, so a prompt reopen is retried briefly.
    fn while_locked<T, E: std::fmt::Display>(
        mut open: impl FnMut() -> Result<T, E>,
        locked: impl Fn(&E) -> bool,
    ) -> Result<T, E> {
        let started = std::time::Instant::now();
        loop {
            match open() {
                Err(err)
                    if locked(&err) && started.elapsed() < std::time::Duration::from_secs(5) =>
                {
                    tracing::debug!(%err, "ledger still locked; retrying");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                result => return result,
            }
        }
    }

    fn ledger_locked(err: &LedgerError) -> bool {
        matches!(err, LedgerError::Storage(sled::Error::Io(_)))
    }

    /// Opens a ledger just closed in this process.
    fn reopen(dir: &Path) -> Ledger {
        while_locked(|| Ledger::open(dir), ledger_locked)
            .unwrap_or_else(|err| panic!("reopening the ledger: {err}"))
    }

    /// The ledger's tree, opened with sled alone.
    fn raw_tree(dir: &Path) -> (sled::Db, sled::Tree) {
        let db = while_locked(|| sled::open(dir), |err| matches!(err, sled::Error::Io(_))).unwrap();
        let tree = db.open_tree("ledger").unwrap();
        (db, tree)
    }

    /// A record whose message has a data part as deep as a request's params
    /// may carry one: the record, and its log frame, nest it deeper than
    /// serde_json's default limit of 128.
    fn deeply_nested(task_id: &str) -> TaskRecord {
        let mut data = serde_json::json!("leaf");
        for _ in 0..124 {
            data = serde_json::Value::Array(vec![data]);
        }
        let mut record = record(task_id);
        record.task.history.push(crate::protocol::Message {
            message_id: "m1".into(),
            parts: vec![crate::protocol::Part::data(data)],
            ..crate::protocol::Message::default()
        });
        record
    }

    #[tokio::test]
    async fn a_record_nested_as_deep_as_accepted_input_reads_back_from_the_log_and_from_sled() {
        let dir = tempfile::tempdir().unwrap();
        let written = deeply_nested("t1");
        let ledger = paused(dir.path());
        let working = status("t1", TaskState::Working);
        ledger.create(written.clone(), vec![working]).await.unwrap();
        // Durable in the log only: the applier never ran.
        ledger.close();
        drop(ledger);

        // Replayed from the log at start-up.
        let ledger = reopen(dir.path());
        let replayed = ledger.get("t1").unwrap().expect("replayed from the log");
        assert_eq!(replayed.task.history, written.task.history);
        ledger.close();
        drop(ledger);

        // Read from sled, and written again (a write reads the record first).
        let ledger = reopen(dir.path());
        let stored = ledger.get("t1").unwrap().expect("read from sled");
        assert_eq!(stored.task.history, written.task.history);
        let completed = status("t1", TaskState::Completed);
        ledger
            .update("t1", |_| Ok::<_, LedgerError>(vec![completed]))
            .await
            .unwrap();
        ledger.close();
    }

    #[tokio::test]
    async fn a_ledger_of_a_later_format_is_refused_and_others_are_marked() {
        let marker = |dir: &Path| {
            let (_db, tree) = raw_tree(dir);
            tree.get(keys::format()).unwrap().map(|v| v.to_vec())
        };
        let set_marker = |dir: &Path, value: Option<&[u8]>| {
            let (db, tree) = raw_tree(dir);
            match value {
                Some(value) => tree.insert(keys::format(), value).unwrap(),
                None => tree.remove(keys::format()).unwrap(),
            };
            db.flush().unwrap();
        };
        let refusal = |dir: &Path| match while_locked(|| Ledger::open(dir), ledger_locked) {
            Ok(_) => panic!("opened"),
            Err(LedgerError::Format(why)) => why,
            Err(err) => panic!("{err}"),
        };

        // A new ledger is marked with this build's format.
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        ledger.create(record("t1"), vec![]).await.unwrap();
        ledger.close();
        drop(ledger);
        let this = LEDGER_FORMAT.to_be_bytes().to_vec();
        assert_eq!(marker(dir.path()), Some(this.clone()));

        // One written before the marker, or in an earlier format, is
        // marked with this build's, its data kept.
        for earlier in [None, Some(UNMARKED_FORMAT.to_be_bytes())] {
            set_marker(dir.path(), earlier.as_ref().map(|m| m.as_slice()));
            let ledger = reopen(dir.path());
            assert_eq!(
                ledger.get("t1").unwrap().map(|r| r.task.id),
                Some("t1".into())
            );
            ledger.close();
            drop(ledger);
            assert_eq!(marker(dir.path()), Some(this.clone()));
        }

        // A later format, or a marker that is not one, is refused and left as is.
        let later = (LEDGER_FORMAT + 1).to_be_bytes();
        set_marker(dir.path(), Some(&later));
        let why = refusal(dir.path());
        assert!(
            why.contains(&format!("format {}", LEDGER_FORMAT + 1)),
            "{why}"
        );
        assert_eq!(marker(dir.path()), Some(later.to_vec()));
        set_marker(dir.path(), Some(b"v2"));
        assert!(refusal(dir.path()).contains("unreadable"));
        assert_eq!(marker(dir.path()), Some(b"v2".to_vec()));
    }

    #[tokio::test]
    async fn finished_tasks_read_back_from_the_record_file_after_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        let mut written = Vec::new();
        for n in 0..6 {
            let mut finished = record(&keys::uuid_v7_at(1_767_000_000_000, n));
            finished.task.status = TaskStatus::now(TaskState::Completed, None);
            written.push(ledger.create(finished, vec![]).await.unwrap());
        }
        ledger.close();
        drop(ledger);
        {
            let (_db, tree) = raw_tree(dir.path());
            let prefix = keys::record_bucket_prefix(&written[0].task.id).unwrap();
            let buckets: Vec<_> = tree
                .scan_prefix(prefix)
                .values()
                .map(Result::unwrap)
                .collect();
            assert!(!buckets.is_empty());
            let file = record_file::RecordFile::open(&dir.path().join(applier::RECORD_FILE), false)
                .unwrap();
            let synced = tree.get(keys::records_synced()).unwrap().unwrap();
            assert_eq!(synced.as_ref(), file.end().to_be_bytes(), "synced at close");
            for bucket in &buckets {
                let pointer = record_file::Pointer::decode(bucket).expect("a pointer");
                let sealed = file.read(&pointer).unwrap().expect("synced at close");
                let opened = keys::open_record_bucket(&sealed);
                assert!(matches!(opened, Some(Cow::Owned(_))), "stored compressed");
            }
        }

        let ledger = reopen(dir.path());
        for record in &written {
            let read = ledger.get(&record.task.id).unwrap();
            assert_eq!(read.as_ref(), Some(&**record));
        }
        ledger.close();
    }

    #[test]
    fn an_unmarked_ledger_is_read_as_the_unmarked_format() {
        let (current, unmarked) = (3, 2);
        let dir = tempfile::tempdir().unwrap();
        let (_db, tree) = raw_tree(dir.path());
        let marker = || {
            let value = tree.get(keys::format()).unwrap().unwrap();
            u32::from_be_bytes(value.as_ref().try_into().unwrap())
        };

        check_format_as(&tree, current, unmarked).unwrap();
        assert_eq!(marker(), current, "an empty tree is a new ledger");
        check_format_as(&tree, current, unmarked).expect("this build's own format opens");

        // Data without a marker predates it: readable by a build whose
        // format is the unmarked one or later, and refused by an earlier.
        tree.clear().unwrap();
        tree.insert(b"t/some-task", b"{}").unwrap();
        assert!(matches!(
            check_format_as(&tree, unmarked - 1, unmarked),
            Err(LedgerError::Format(_))
        ));
        assert_eq!(tree.get(keys::format()).unwrap(), None, "left as is");
        check_format_as(&tree, current, unmarked).unwrap();
        assert_eq!(marker(), current);
    }

    #[tokio::test]
    async fn replies_shaped_from_sled_are_the_decoded_tasks_views() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = paused(dir.path());
        let bucketed = "0199c5a4-1e00-7000-8000-000000000001";
        let own_key = "own-key-task";
        for task_id in [bucketed, own_key] {
            let mut record = record(task_id);
            record.task.history = (1..=3)
                .map(|n| crate::protocol::Message {
                    message_id: format!("m{n}"),
                    role: crate::protocol::Role::User,
                    parts: vec![crate::protocol::Part::text(format!("turn {n}"))],
                    ..crate::protocol::Message::default()
                })
                .collect();
            record.task.artifacts = vec![crate::protocol::Artifact {
                artifact_id: "a1".into(),
                parts: vec![crate::protocol::Part::text("result")],
                ..crate::protocol::Artifact::default()
            }];
            let events = vec![status(task_id, TaskState::Completed)];
            ledger.create(record, events).await.unwrap();
        }
        ledger.applier.apply_pending().unwrap();
        // Once a later set is applied, both are read from sled.
        ledger.create(record("later"), vec![]).await.unwrap();
        ledger.applier.apply_pending().unwrap();
        assert!(ledger.tree.get(keys::task(bucketed)).unwrap().is_none());
        assert!(ledger.tree.get(keys::task(own_key)).unwrap().is_some());
        for task_id in [bucketed, own_key] {
            let task = ledger.get(task_id).unwrap().unwrap().task;
            for history_length in [None, Some(0), Some(2), Some(3), Some(9)] {
                for include_artifacts in [true, false] {
                    let read = ledger.get_for_reply(task_id).unwrap().unwrap();
                    assert!(matches!(read, ReplyTask::Stored(_)), "{task_id}");
                    assert_eq!(read.owner().unwrap(), "owner");
                    let reply =
                        crate::gateway::TaskReply::read(read, history_length, include_artifacts);
                    assert_eq!(
                        serde_json::to_string(&reply).unwrap(),
                        serde_json::to_string(
                            &task.borrowed_view(history_length, include_artifacts)
                        )
                        .unwrap(),
                        "{task_id} {history_length:?} {include_artifacts}"
                    );
                }
            }
        }
    }

    #[tokio::test]
    async fn a_clean_close_moves_everything_into_sled_and_deletes_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_working_task(Ledger::open(dir.path()).unwrap(), "t1").await;
        flip(&ledger, "t1", 2).await;
        let key = keys::idempotency("owner", "k");
        ledger
            .write_raw(key.clone(), Some(b"{}".to_vec()))
            .await
            .unwrap();
        assert!(!wal::segments(&dir.path().join("wal")).unwrap().is_empty());
        ledger.close();
        drop(ledger);
        assert!(wal::segments(&dir.path().join("wal")).unwrap().is_empty());

        let reopened = reopen(dir.path());
        let record = reopened.get("t1").unwrap().unwrap();
        assert_eq!(record.version, 3);
        assert_eq!(reopened.read_raw(&key).unwrap(), Some(b"{}".to_vec()));
        assert_eq!(reopened.events_after("t1", 0).unwrap().0.events.len(), 3);
    }

    #[test]
    fn an_open_that_fails_leaves_the_ledger_free_to_open_again() {
        let dir = tempfile::tempdir().unwrap();
        wal::FAIL_NEXT_CREATE.set(true);
        assert!(Ledger::open(dir.path()).is_err(), "no log segment");
        reopen(dir.path()).close();
    }

    /// The log a crashed process left: three raw puts in one segment, the
    /// middle or last one changed by `damage` (given each frame's range).
    /// Returns the segment's frames as written.
    fn crashed_log_of_three(
        dir: &Path,
        damage: fn(&mut Vec<u8>, &[std::ops::Range<usize>]),
    ) -> Vec<u8> {
        let mut frames = Vec::new();
        let mut ranges = Vec::new();
        for name in ["k1", "k2", "k3"] {
            let start = frames.len();
            let key = keys::idempotency("owner", name);
            let entry = wal::EntryRef::Put {
                key: &key,
                value: b"{}",
            };
            wal::encode(&mut frames, &entry).unwrap();
            ranges.push(start..frames.len());
        }
        damage(&mut frames, &ranges);
        let mut segment = wal::Segment::create(&dir.join("wal"), 1).unwrap();
        segment.append_durably(&frames).unwrap();
        frames
    }

    #[test]
    fn damage_in_the_last_log_segment_is_kept_and_a_torn_tail_is_not() {
        // What precedes the damage is replayed either way.
        let undecodable: fn(&mut Vec<u8>, &[std::ops::Range<usize>]) = |frames, ranges| {
            // A checksum that holds, over a frame this build does not know.
            let payload = br#"{"op":"Bogus"}"#;
            let mut frame = (payload.len() as u32).to_le_bytes().to_vec();
            frame.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
            frame.extend_from_slice(payload);
            frames.splice(ranges[1].clone(), frame);
        };
        let flipped: fn(&mut Vec<u8>, &[std::ops::Range<usize>]) = |frames, ranges| {
            frames[ranges[1].end - 3] ^= 0xff;
        };
        let torn: fn(&mut Vec<u8>, &[std::ops::Range<usize>]) = |frames, ranges| {
            // Cut short, the zero-filled space after it.
            frames.truncate(ranges[2].end - 3);
        };
        for (case, damage, replayed, kept) in [
            ("undecodable", undecodable, 1, true),
            ("checksum failing before a frame", flipped, 1, true),
            ("torn last frame", torn, 2, false),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let frames = crashed_log_of_three(dir.path(), damage);
            let ledger = Ledger::open(dir.path()).unwrap();
            for (n, name) in ["k1", "k2", "k3"].into_iter().enumerate() {
                let read = ledger.read_raw(&keys::idempotency("owner", name)).unwrap();
                assert_eq!(read.is_some(), n < replayed, "{case}: {name}");
            }
            ledger.close();
            drop(ledger);
            let wal_dir = dir.path().join("wal");
            assert!(wal::segments(&wal_dir).unwrap().is_empty(), "{case}");
            let damaged = wal_dir.join("damaged");
            if !kept {
                assert!(!damaged.exists(), "{case}");
                continue;
            }
            let folders: Vec<_> = std::fs::read_dir(&damaged)
                .unwrap_or_else(|err| panic!("{case}: nothing kept: {err}"))
                .map(|entry| entry.unwrap().path())
                .collect();
            let [folder] = folders.as_slice() else {
                panic!("{case}: one folder of damaged segments: {folders:?}");
            };
            let segment = std::fs::read(folder.join(format!("{:020}.log", 1))).unwrap();
            assert_eq!(segment[..frames.len()], frames, "{case}: kept whole");
        }
    }

    #[tokio::test]
    async fn a_task_just_applied_is_read_without_decoding_until_the_next_set() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_working_task(paused(dir.path()), "t1").await;
        let written = ledger.get_shared("t1").unwrap().unwrap();
        ledger.applier.apply_pending().unwrap();
        // The set applied last is still shared: the same record, not a copy.
        let read = ledger.get_shared("t1").unwrap().unwrap();
        assert!(Arc::ptr_eq(&written, &read));
        // A newer write, pending, comes before the applied set.
        flip(&ledger, "t1", 1).await;
        let newer = ledger.get_shared("t1").unwrap().unwrap();
        assert_eq!(newer.version, written.version + 1);
        ledger.applier.apply_pending().unwrap();
        let written = ledger.get_shared("t1").unwrap().unwrap();
        assert!(Arc::ptr_eq(&newer, &written));

        ledger.create(record("t2"), vec![]).await.unwrap();
        ledger.applier.apply_pending().unwrap();
        // Once another set is applied, t1 comes from sled, and is the same task.
        let decoded = ledger.get_shared("t1").unwrap().unwrap();
        assert!(!Arc::ptr_eq(&written, &decoded));
        assert_eq!(*decoded, *written);
        assert!(ledger.applier.task("t2").is_some());
    }

    #[tokio::test]
    async fn finished_tasks_read_back_from_their_record_buckets() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = paused(dir.path());
        // UUIDv7 ids of two creation milliseconds, their buckets side by side.
        let mut ids = Vec::new();
        for n in 0..12u16 {
            let millis: u64 = 1_767_000_000_000 + u64::from(n % 2);
            let task_id = keys::uuid_v7_at(millis, n);
            let events = vec![status(&task_id, TaskState::Completed)];
            ledger.create(record(&task_id), events).await.unwrap();
            ids.push(task_id);
        }
        ledger.applier.apply_pending().unwrap();
        // A later write of a bucketed task goes to a key of its own.
        let edited = ids[4].clone();
        ledger
            .update(&edited, |record| {
                record.agent = "edited".into();
                Ok::<_, LedgerError>(Vec::new())
            })
            .await
            .unwrap();
        ledger.applier.apply_pending().unwrap();
        // Reopened (the log replayed over what sled holds): reads go to sled.
        drop(ledger);
        let ledger = &reopen(dir.path());
        for task_id in &ids {
            let bucketed = ledger.tree.get(keys::task(task_id)).unwrap().is_none();
            assert_eq!(bucketed, *task_id != edited, "{task_id}");
            let read = ledger.get_for_reply(task_id).unwrap().expect("read back");
            assert!(matches!(read, ReplyTask::Stored(_)), "read from sled");
            assert_eq!(read.state().unwrap(), TaskState::Completed);
            assert_eq!(decoded(read).task.id, *task_id);
        }
        ids.sort();
        for state in [Some(TaskState::Completed), None] {
            let (mut listed, total) = list_all(ledger, state, 5);
            listed.sort();
            assert_eq!((&listed, total), (&ids, 12));
        }
        // Listing reads the task's own key, not its bucket's older copy.
        for state in [Some(TaskState::Completed), None] {
            let query = ListQuery {
                state,
                page_size: 100,
                ..ListQuery::default()
            };
            let page = ledger.list("owner", &query).unwrap();
            for record in page.records.into_iter().map(decoded) {
                let agent = if record.task.id == edited {
                    "edited"
                } else {
                    "agent"
                };
                assert_eq!(record.agent, agent);
            }
        }
    }

    /// Every page of the owner's tasks (in `state`, if given), as ids in
    /// order, with the total the pages reported (checked the same on each).
    fn list_all(
        ledger: &Ledger,
        state: Option<TaskState>,
        page_size: usize,
    ) -> (Vec<String>, usize) {
        let mut seen = Vec::new();
        let mut page_token = None;
        let mut total = None;
        loop {
            let query = ListQuery {
                state,
                page_size,
                page_token: page_token.take(),
                ..ListQuery::default()
            };
            let page = ledger.list("owner", &query).unwrap();
            assert_eq!(*total.get_or_insert(page.total_size), page.total_size);
            seen.extend(page.records.into_iter().map(|r| decoded(r).task.id.clone()));
            if page.next_page_token.is_empty() {
                return (seen, page.total_size);
            }
            page_token = decode_page_token(&page.next_page_token);
        }
    }

    #[tokio::test]
    async fn listing_all_merges_the_state_indexes_newest_first_across_pages() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        // Alternating states, so every page draws from several indexes.
        let states = [TaskState::Working, TaskState::Completed, TaskState::Failed];
        for i in 0..9 {
            let id = format!("t{i}");
            let event = status(&id, states[i % 3]);
            ledger.create(record(&id), vec![event]).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        ledger.applier.apply_pending().unwrap();
        let newest_first: Vec<String> = (0..9).rev().map(|i| format!("t{i}")).collect();
        assert_eq!(list_all(&ledger, None, 4), (newest_first, 9));
    }

    #[tokio::test]
    async fn buckets_and_single_entries_list_merged_once_across_pages() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        let millis = |ms: i64| DateTime::from_timestamp_millis(1_700_000_000_000 + ms);
        // Millisecond 1 holds three COMPLETED tasks and two WORKING ones; its
        // neighbours one each. Ids sort within a millisecond.
        let tasks = [
            ("n1", TaskState::Completed, 2),
            ("c1", TaskState::Completed, 1),
            ("c2", TaskState::Completed, 1),
            ("c3", TaskState::Completed, 1),
            ("c5", TaskState::Completed, 1),
            ("w2", TaskState::Working, 1),
            ("w4", TaskState::Working, 1),
            ("o1", TaskState::Completed, 0),
            ("o2", TaskState::Working, 0),
        ];
        for (id, state, ms) in tasks {
            let event = StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                task_id: id.to_string(),
                context_id: "ctx".into(),
                status: TaskStatus {
                    state,
                    timestamp: millis(ms),
                    ..TaskStatus::default()
                },
                ..TaskStatusUpdateEvent::default()
            });
            ledger.create(record(id), vec![event]).await.unwrap();
        }
        ledger.applier.apply_pending().unwrap();
        let completed = keys::by_state_prefix("owner", TaskState::Completed.number());
        let bucket = [completed.as_slice(), &keys::order(millis(1), "")].concat();
        let held = ledger.tree.get(&bucket).unwrap().unwrap();
        assert_eq!(
            keys::bucket_ids(&held),
            [b"c1".as_slice(), b"c2", b"c3", b"c5"]
        );
        // As a ledger from before buckets left them: c2 a key of its own,
        // and c3 both (replayed into a bucket).
        ledger
            .tree
            .insert(
                &bucket,
                keys::bucket_value([b"c1".as_slice(), b"c3", b"c5"]),
            )
            .unwrap();
        for id in ["c2", "c3"] {
            let single = [completed.as_slice(), &keys::order(millis(1), id)].concat();
            ledger.tree.insert(single, &[]).unwrap();
        }

        let list = |state, page_size| list_all(&ledger, state, page_size);
        let all = ["n1", "c1", "c2", "c3", "c5", "w2", "w4", "o1", "o2"];
        for page_size in [1, 2, 3, 100] {
            assert_eq!(list(None, page_size), (all.map(String::from).to_vec(), 9));
        }
        let settled = ["n1", "c1", "c2", "c3", "c5", "o1"];
        assert_eq!(
            list(Some(TaskState::Completed), 2),
            (settled.map(String::from).to_vec(), 6)
        );
        let after = ListQuery {
            status_after: millis(1),
            page_size: 100,
            ..ListQuery::default()
        };
        assert_eq!(ledger.list("owner", &after).unwrap().records.len(), 7);
    }

    #[tokio::test]
    async fn a_full_bucket_and_its_spilled_keys_list_in_order_across_pages() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        let at = DateTime::from_timestamp_millis(1_700_000_000_000);
        // More COMPLETED tasks in one millisecond than a bucket holds, in two
        // applications whose ids interleave (so the spilled ones fall between
        // the bucket's), and WORKING ones among them.
        for parity in [0, 1] {
            for n in (parity..200).step_by(2) {
                let id = format!("t{n:03}");
                let state = if n % 10 == 3 {
                    TaskState::Working
                } else {
                    TaskState::Completed
                };
                let event = StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                    task_id: id.clone(),
                    context_id: "ctx".into(),
                    status: TaskStatus {
                        state,
                        timestamp: at,
                        ..TaskStatus::default()
                    },
                    ..TaskStatusUpdateEvent::default()
                });
                ledger.create(record(&id), vec![event]).await.unwrap();
            }
            ledger.applier.apply_pending().unwrap();
        }
        let ids: Vec<String> = (0..200).map(|n| format!("t{n:03}")).collect();
        let completed = keys::by_state_prefix("owner", TaskState::Completed.number());
        let spilled = ledger
            .tree
            .scan_prefix(&completed)
            .keys()
            .filter(|key| !keys::is_bucket_suffix(&key.as_ref().unwrap()[completed.len()..]))
            .count();
        assert_eq!(spilled, 180 - 128, "the rest of the millisecond spilled");
        for page_size in [1, 7, 100] {
            let listed = list_all(&ledger, None, page_size);
            assert_eq!(listed, (ids.clone(), 200), "page size {page_size}");
        }
    }

    #[tokio::test]
    async fn opening_removes_the_retired_all_tasks_index() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = with_working_task(Ledger::open(dir.path()).unwrap(), "t1").await;
        let retired = [keys::retired_by_time_prefix(), b"owner\0order"].concat();
        ledger.tree.insert(&retired, &[]).unwrap();
        ledger.close();
        drop(ledger);

        let reopened = reopen(dir.path());
        assert_eq!(reopened.tree.get(&retired).unwrap(), None);
        let all = reopened
            .list(
                "owner",
                &ListQuery {
                    page_size: 10,
                    ..ListQuery::default()
                },
            )
            .unwrap();
        assert_eq!(all.records.len(), 1);
    }
}
