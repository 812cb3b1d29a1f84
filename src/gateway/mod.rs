//! The A2A methods on top of the ledger and the agents: what each of the
//! eleven methods does, independent of the JSON-RPC transport.

mod driver;
mod relay;
mod send;
mod stream;
mod trace;
pub mod validate;

pub use send::{SendOutcome, SendReply};
pub use stream::TaskEventStream;
pub use trace::{MAX_TRACE_DEPTH, MAX_TRACE_NODES, TraceNode, TraceReport};

use crate::agents::{AgentEvents, FollowUpReceiver, FollowUpSender, UpstreamRef};
use crate::error::GatewayError;
use crate::protocol::*;
use crate::push::PushDispatcher;
use crate::registry::{AgentEntry, Directory};
use crate::store::{self, Change, Ledger, LedgerError, ListQuery, ReadTask, ReplyTask, TaskRecord};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use validate::{check_history_length, check_required, finish};

/// How many holders one CancelTask asks in turn, when each answers "not
/// cancelable" because the task moved on to the next.
const MAX_HOLDERS_ASKED: usize = 4;

/// How long a CancelTask waits for the end of a holder that said its task
/// cannot be canceled, to see whether that end handed the task on.
const HOLDER_END_WAIT: Duration = Duration::from_secs(2);

/// Follow-ups one execution holds before their senders wait: each waits for
/// its agent's answer anyway.
const FOLLOW_UP_QUEUE: usize = 16;

impl From<LedgerError> for GatewayError {
    fn from(err: LedgerError) -> Self {
        match err {
            LedgerError::NotFound(id) => GatewayError::TaskNotFound(id),
            LedgerError::Transition(t) => GatewayError::UnsupportedOperation(t.to_string()),
            LedgerError::Unavailable(failure) => GatewayError::LedgerUnavailable(failure),
            other => GatewayError::Internal(other.to_string()),
        }
    }
}

/// A task as a reply (`GetTask`, `ListTasks`, `SendMessage`): a record at
/// hand is written through [`Task::borrowed_view`] (or as the JSON its write
/// encoded, when the reply is the whole task), and a record sled holds is
/// shaped from its task's JSON without decoding it.
#[derive(Debug)]
pub struct TaskReply {
    task: ReplyTask,
    history_length: Option<i32>,
    include_artifacts: bool,
}

impl TaskReply {
    /// `record`'s task with at most `history_length` recent messages.
    pub fn new(record: Arc<TaskRecord>, history_length: Option<i32>) -> Self {
        // A record at hand was written durably (or read as such).
        let read = ReadTask {
            record,
            task_json: None,
            ticket: 0,
        };
        Self::read(ReplyTask::Read(read), history_length, true)
    }

    /// A task read for a reply, with at most `history_length` recent
    /// messages, and its artifacts if `include_artifacts`.
    pub fn read(task: ReplyTask, history_length: Option<i32>, include_artifacts: bool) -> Self {
        Self {
            task,
            history_length,
            include_artifacts,
        }
    }
}

impl serde::Serialize for TaskReply {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (history_length, include_artifacts) = (self.history_length, self.include_artifacts);
        match &self.task {
            ReplyTask::Read(read) => {
                let task = &read.record.task;
                match &read.task_json {
                    Some(json) if task.view_is_whole(history_length, include_artifacts) => {
                        json.serialize(serializer)
                    }
                    _ => task
                        .borrowed_view(history_length, include_artifacts)
                        .serialize(serializer),
                }
            }
            ReplyTask::Stored(stored) => match stored.task_json() {
                Ok(task) => task
                    .view(history_length, include_artifacts)
                    .serialize(serializer),
                Err(err) => {
                    tracing::error!(%err, "corrupt task record in the ledger");
                    Err(serde::ser::Error::custom(format!(
                        "corrupt task record in the ledger: {err}"
                    )))
                }
            },
        }
    }
}

/// Who is calling and where the call was addressed.
#[derive(Clone, Debug)]
pub struct CallContext {
    /// The authenticated principal (`anonymous` without keys).
    pub principal: String,
    /// The agent the call is addressed to.
    pub agent_id: String,
    /// The `Idempotency-Key` header, or the messageId when the handoff
    /// extension is active.
    pub idempotency_key: Option<String>,
    /// Handoff control from the request's headers (trace context, `Baton-*`).
    pub incoming: crate::handoff::control::Incoming,
    /// The caller named the agent (by path or tenant), rather than leaving
    /// the choice to the gateway.
    pub pinned: bool,
    /// The extension URIs the caller activated (`A2A-Extensions`), checked
    /// against the card of the agent a send reaches.
    pub extensions: Vec<String>,
    /// A `params.tenant` naming no agent that a routing rule matches
    /// (DESIGN.md §5): the call is the gateway's, and its rules see it.
    pub tenant_label: Option<String>,
}

/// Gateway-wide settings the methods need.
#[derive(Clone, Debug)]
pub struct GatewaySettings {
    /// Longest a blocking SendMessage waits before returning the task as it is.
    pub task_timeout: Duration,
    /// Push notifications are offered; when false every push method is -32003.
    pub push_enabled: bool,
    /// Largest hop count of a line of work (DESIGN.md §3.1).
    pub max_hops: u32,
    /// Rules choosing the agent of `/a2a` calls that name none (DESIGN.md §5).
    pub routing: Arc<crate::handoff::routing::RoutingRules>,
    /// How long a handoff's target may take to acknowledge (DESIGN.md §3.3).
    pub ack_timeout: Duration,
    /// The pause before a handoff is retried after no acknowledgement.
    pub retry_delay: Duration,
    /// An exhausted ladder leaves the task INPUT_REQUIRED (`ESCALATED`) for
    /// the caller to decide, instead of failing it (`TARGET_UNAVAILABLE`).
    pub escalate: bool,
    /// Most events one task may hold. An agent reporting past it is told to
    /// stop (`CancelTask` for a remote agent), and the task fails with
    /// `EVENT_LIMIT_EXCEEDED`: every write rewrites the task's whole record,
    /// so an agent could otherwise grow one task, and the ledger, until its
    /// deadline. A client's message to a task holding that many is refused
    /// (-32004).
    pub max_task_events: u64,
    /// Longest a task's stored record (its JSON, which every write
    /// rewrites) may grow. An agent report past it stops the agent, as the
    /// event limit does, and the task fails with `TASK_SIZE_EXCEEDED`; a
    /// client's message past it is refused (-32602).
    pub max_task_bytes: usize,
}

impl GatewaySettings {
    /// The bounds on a task that an agent's report or a client's message
    /// may not pass.
    pub fn task_limits(&self) -> store::TaskLimits {
        store::TaskLimits {
            max_events: self.max_task_events,
            max_bytes: self.max_task_bytes,
        }
    }
}

impl Default for GatewaySettings {
    fn default() -> Self {
        Self {
            task_timeout: Duration::from_secs(300),
            push_enabled: true,
            max_hops: 5,
            routing: Arc::default(),
            ack_timeout: Duration::from_secs(5),
            retry_delay: Duration::from_secs(2),
            escalate: false,
            max_task_events: DEFAULT_MAX_TASK_EVENTS,
            max_task_bytes: DEFAULT_MAX_TASK_BYTES,
        }
    }
}

/// The default of [`GatewaySettings::max_task_events`]: far more than a
/// task's status changes and artifacts, enough for an agent that streams
/// its answer in thousands of chunks.
pub const DEFAULT_MAX_TASK_EVENTS: u64 = 10_000;

/// The default of [`GatewaySettings::max_task_bytes`] (64 MiB): four of the
/// largest answers an agent may send.
pub const DEFAULT_MAX_TASK_BYTES: usize = 64 * 1024 * 1024;

/// A task drivers work on.
struct RunningTask {
    /// Shared by every driver on the task, so one CancelTask stops them all.
    cancel: CancellationToken,
    /// How many drivers work on it (a continuation may start while the
    /// previous one ends).
    drivers: usize,
    /// The agent whose execution follows the task now, and where it takes
    /// follow-ups.
    follower: Option<RegisteredFollower>,
}

/// An agent whose execution follows a task, and where it takes follow-ups.
pub(crate) type RegisteredFollower = (String, FollowUpSender);

/// Sends `agent` CancelTask for `task` (its task `upstream` there), on a
/// task of its own, so that an agent slow to answer holds up nothing.
pub(crate) fn tell_canceled(agent: Arc<AgentEntry>, task: Task, upstream: Option<UpstreamRef>) {
    tokio::spawn(async move {
        if let Err(err) = agent.agent.cancel(&task, upstream.as_ref()).await {
            tracing::warn!(task_id = %task.id, agent = %agent.id, %err, "the agent did not confirm the cancel");
        }
    });
}

/// The A2A service: eleven methods over the ledger and the agents.
pub struct Gateway {
    pub(crate) ledger: Arc<Ledger>,
    directory: Arc<Directory>,
    pub(crate) push: PushDispatcher,
    pub(crate) settings: GatewaySettings,
    /// Every task a driver works on, by id.
    // std Mutex: map operations only, never held across .await.
    running: Mutex<store::TaskMap<RunningTask>>,
    /// The numbers of the idempotency claims sends of this run hold
    /// ([`send::HeldClaim`]), and the last number given.
    claims_held: Mutex<std::collections::HashSet<u64>>,
    last_claim_number: std::sync::atomic::AtomicU64,
    /// Canceled at shutdown: ends streams and agent work.
    pub(crate) shutdown: CancellationToken,
    /// Turns of the round-robin among agents sharing a skill.
    balance: std::sync::atomic::AtomicU64,
    /// Handoff metrics, served at `GET /metrics`.
    pub metrics: Arc<crate::metrics::HandoffMetrics>,
}

impl Gateway {
    /// A gateway over `ledger` serving the agents of `directory`.
    pub fn new(
        ledger: Arc<Ledger>,
        directory: Arc<Directory>,
        push: PushDispatcher,
        settings: GatewaySettings,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        let metrics = Arc::<crate::metrics::HandoffMetrics>::default();
        let observed = metrics.clone();
        ledger.observe_transitions(Box::new(move |from, to, elapsed| {
            observed.transition(from, to, elapsed);
        }));
        Arc::new(Self {
            ledger,
            directory,
            push,
            settings,
            running: Mutex::default(),
            claims_held: Mutex::default(),
            last_claim_number: std::sync::atomic::AtomicU64::new(0),
            shutdown,
            balance: std::sync::atomic::AtomicU64::new(0),
            metrics,
        })
    }

    /// The ledger.
    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// The next turn of the round-robin among agents sharing a skill.
    pub(crate) fn next_balance(&self) -> u64 {
        self.balance
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether push notifications are offered.
    pub fn push_enabled(&self) -> bool {
        self.settings.push_enabled
    }

    /// -32003 when push notifications are off; checked before anything else.
    pub(crate) fn check_push_enabled(&self) -> Result<(), GatewayError> {
        if self.settings.push_enabled {
            Ok(())
        } else {
            Err(GatewayError::PushNotificationNotSupported)
        }
    }

    /// Push delivery and its counters.
    pub fn push(&self) -> &PushDispatcher {
        &self.push
    }

    /// An agent by id.
    pub fn agent(&self, id: &str) -> Option<Arc<AgentEntry>> {
        self.directory.get(id)
    }

    /// The agents the gateway routes to.
    pub fn directory(&self) -> &Arc<Directory> {
        &self.directory
    }

    /// A task the caller may see; others' tasks are reported as not found.
    fn owned_task(
        &self,
        ctx: &CallContext,
        task_id: &str,
    ) -> Result<Arc<TaskRecord>, GatewayError> {
        self.ledger
            .get_shared(task_id)?
            .filter(|record| record.owner == ctx.principal)
            .ok_or_else(|| GatewayError::TaskNotFound(task_id.to_string()))
    }

    /// Whether `principal` may extend `parent`'s line of work (link a child
    /// under it, inherit its hops, chain and deadline): it is the task's
    /// own, or it is the agency whose agent holds it now, which delegates
    /// under its own key. (Not one that held it before: the work moved
    /// on.) Without keys every caller is the one anonymous principal.
    pub(crate) fn extends(&self, principal: &str, parent: &TaskRecord) -> bool {
        parent.owner == principal
            || self
                .agent(&parent.agent)
                .is_some_and(|holder| holder.owner == principal)
    }

    /// The task `task_id` when the caller may extend its line of work (see
    /// [`Self::extends`]).
    fn lineage_task(&self, ctx: &CallContext, task_id: &str) -> Option<Arc<TaskRecord>> {
        self.ledger
            .get_shared(task_id)
            .ok()
            .flatten()
            .filter(|parent| self.extends(&ctx.principal, parent))
    }

    /// The parent a new task of `owner` is linked under, of the one its
    /// control names: none when `owner` may not extend that task's line of
    /// work ([`Self::extends`]), since the link puts the child into the
    /// parent's trace and its cancel. A parent this ledger does not hold
    /// stays named: it may be another gateway's.
    pub(crate) fn linked_parent(&self, owner: &str, named: Option<&str>) -> Option<String> {
        let named = named?;
        match self.ledger.get_shared(named) {
            Ok(None) => Some(named.to_string()),
            Ok(Some(parent)) if self.extends(owner, &parent) => Some(named.to_string()),
            Ok(Some(_)) => None,
            Err(err) => {
                tracing::warn!(%err, parent = named, "the named parent could not be read; the task is not linked to it");
                None
            }
        }
    }

    /// A task of the caller's, returned once what it shows is durable: a
    /// read may see writes noted after any sync the caller waited for.
    async fn owned_durable_task(
        &self,
        ctx: &CallContext,
        task_id: &str,
    ) -> Result<Arc<TaskRecord>, GatewayError> {
        match self.ledger.get_for_reply(task_id)? {
            Some(task) if task.owner()? == ctx.principal => {
                self.ledger.until_durable(task.ticket()).await?;
                Ok(task.into_record()?)
            }
            _ => Err(GatewayError::TaskNotFound(task_id.to_string())),
        }
    }

    /// A task of the caller's, read for a reply once what it shows is
    /// durable.
    async fn owned_reply(
        &self,
        ctx: &CallContext,
        task_id: &str,
        history_length: Option<i32>,
    ) -> Result<TaskReply, GatewayError> {
        match self.ledger.get_for_reply(task_id)? {
            Some(task) if task.owner()? == ctx.principal => {
                self.ledger.until_durable(task.ticket()).await?;
                Ok(TaskReply::read(task, history_length, true))
            }
            _ => Err(GatewayError::TaskNotFound(task_id.to_string())),
        }
    }

    /// `GetTask`.
    pub async fn get_task(
        &self,
        ctx: &CallContext,
        req: GetTaskRequest,
    ) -> Result<TaskReply, GatewayError> {
        let mut violations = Vec::new();
        check_required(&req.id, "id", &mut violations);
        check_history_length(req.history_length, "historyLength", &mut violations);
        finish(violations)?;
        self.owned_reply(ctx, &req.id, req.history_length).await
    }

    /// `ListTasks`.
    pub async fn list_tasks(
        &self,
        ctx: &CallContext,
        req: ListTasksRequest,
    ) -> Result<ListTasksResponse<TaskReply>, GatewayError> {
        let mut violations = Vec::new();
        let page_size = req.page_size.unwrap_or(validate::DEFAULT_PAGE_SIZE);
        if !(1..=validate::MAX_PAGE_SIZE).contains(&page_size) {
            violations.push(crate::error::FieldViolation::new(
                "pageSize",
                format!(
                    "must be between 1 and {}, got {page_size}",
                    validate::MAX_PAGE_SIZE
                ),
            ));
        }
        check_history_length(req.history_length, "historyLength", &mut violations);
        let page_token = if req.page_token.is_empty() {
            None
        } else {
            let decoded = store::decode_page_token(&req.page_token);
            if decoded.is_none() {
                violations.push(crate::error::FieldViolation::new(
                    "pageToken",
                    "is not a token this server issued",
                ));
            }
            decoded
        };
        finish(violations)?;

        let query = ListQuery {
            context_id: (!req.context_id.is_empty()).then(|| req.context_id.clone()),
            state: (!req.status.is_unspecified()).then_some(req.status),
            status_after: req.status_timestamp_after,
            page_size: page_size as usize,
            page_token,
        };
        let page = self.ledger.list(&ctx.principal, &query)?;
        let newest = page.records.iter().map(ReplyTask::ticket).max();
        self.ledger.until_durable(newest.unwrap_or(0)).await?;
        let include_artifacts = req.include_artifacts.unwrap_or(false);
        Ok(ListTasksResponse {
            tasks: page
                .records
                .into_iter()
                .map(|task| TaskReply::read(task, req.history_length, include_artifacts))
                .collect(),
            next_page_token: page.next_page_token,
            page_size,
            total_size: i32::try_from(page.total_size).unwrap_or(i32::MAX),
        })
    }

    /// `CancelTask`.
    pub async fn cancel_task(
        self: &Arc<Self>,
        ctx: &CallContext,
        req: CancelTaskRequest,
    ) -> Result<Task, GatewayError> {
        let mut violations = Vec::new();
        check_required(&req.id, "id", &mut violations);
        finish(violations)?;
        let not_cancelable = |state: TaskState| GatewayError::TaskNotCancelable {
            task_id: req.id.clone(),
            state: state.proto_name().to_string(),
        };
        // The holder last asked to cancel; a later one gets its CancelTask
        // after the gateway's (`cancel_later_holder`).
        let mut asked = self.owned_task(ctx, &req.id)?;
        let mut holders_left = MAX_HOLDERS_ASKED;
        loop {
            if asked.task.status.state.is_terminal() {
                // A terminal state read may not be durable yet.
                self.ledger.sync_unless_failing().await?;
                // A cascade that a crash cut short is finished by a retry.
                if asked.task.status.state == TaskState::Canceled {
                    self.cascade_cancel(&req.id).await;
                }
                return Err(not_cancelable(asked.task.status.state));
            }
            let Some(agent) = self.agent(&asked.agent) else {
                break;
            };
            match agent
                .agent
                .cancel(&asked.task, asked.upstream.as_ref())
                .await
            {
                Ok(()) => break,
                // The agent says its task cannot be canceled: the caller's
                // answer while that agent's end is the task's. It is not
                // when a source waits for the result (the task goes on
                // there: the gateway cancels it), nor once the task moved
                // on (a result returned to its source): its new holder is
                // asked, or told after the gateway's cancel.
                Err(refused @ crate::agents::AgentError::Refused { code: -32002, .. }) => {
                    let mut now = self.owned_task(ctx, &req.id)?;
                    if now.same_holder(&asked) {
                        let returns = now.transfer.as_ref().and_then(|t| t.result_goes_to());
                        if returns.is_some() {
                            break;
                        }
                        // Its task ended, and that end may be a handoff the
                        // gateway has yet to record.
                        now = self.holders_end(ctx, &asked).await?;
                        if now.task.status.state.is_terminal() {
                            asked = now;
                            continue;
                        }
                        if now.same_holder(&asked) {
                            // The caller's own error, about its task: not the
                            // agent's, which names the agent's task.
                            tracing::info!(task_id = %req.id, %refused, "the agent refused to cancel");
                            return Err(not_cancelable(now.task.status.state));
                        }
                    }
                    holders_left -= 1;
                    if holders_left == 0 {
                        break;
                    }
                    asked = now;
                }
                // An agent that cannot be reached, or refuses otherwise (one that
                // forgot its task answers -32001 for a task the caller still
                // holds), cannot keep the caller's task alive.
                Err(err) => {
                    tracing::warn!(task_id = %req.id, %err, "agent did not confirm the cancel; canceling at the gateway");
                    break;
                }
            }
        }
        self.stop_driver_and_release_sources(&req.id).await;
        let record = self
            .ledger
            .update(&req.id, |record| {
                let state = record.task.status.state;
                // The agent confirmed the cancel, and its own CANCELED can reach
                // the ledger first (the driver follows the agent): that is
                // this cancel's outcome, not a task that could not be canceled.
                if state == TaskState::Canceled {
                    return Ok(Change::Unchanged);
                }
                if state.is_terminal() {
                    return Err(not_cancelable(state));
                }
                let events = vec![StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                    task_id: record.task.id.clone(),
                    context_id: record.task.context_id.clone(),
                    status: TaskStatus::now(TaskState::Canceled, None),
                    metadata: req.metadata.clone(),
                })];
                // The holder's hop ends here, and a delivery kept for a
                // restart is not made any more.
                driver::note_hop(record, &events, false, chrono::Utc::now());
                Ok(Change::Made(events))
            })
            .await?;
        self.cancel_later_holder(&asked, &record);
        self.cascade_cancel(&req.id).await;
        Ok(record.task.view(None, true))
    }

    /// Cancels the handoff graph below `task_id` (see
    /// [`Gateway::cancel_children`]) on a task of its own: a caller that
    /// hangs up, which drops its request's future, does not cut it short.
    async fn cascade_cancel(self: &Arc<Self>, task_id: &str) {
        let gateway = self.clone();
        let task_id = task_id.to_string();
        let cascade = tokio::spawn(async move { gateway.cancel_children(&task_id).await });
        if let Err(err) = cascade.await {
            tracing::error!(%err, "the cancel cascade stopped");
        }
    }

    /// A task just made under `parent`: canceled with the rest of the
    /// parent's graph if the parent was canceled meanwhile (a cascade
    /// cancels the children it finds, and this one may have come after).
    pub(crate) async fn join_canceled_parent(&self, parent: Option<&str>) {
        let Some(parent) = parent else {
            return;
        };
        if let Ok(Some(record)) = self.ledger.get_shared(parent)
            && record.task.status.state == TaskState::Canceled
        {
            self.cancel_children(parent).await;
        }
    }

    /// The task as it is once the gateway has its holder's end: a terminal
    /// state or another holder. A holder that says its task cannot be
    /// canceled has ended it, but its last events may still be on their
    /// way; waited for up to `HOLDER_END_WAIT`, and not at all when no
    /// driver follows the task (read again at each of its events).
    async fn holders_end(
        &self,
        ctx: &CallContext,
        holder: &TaskRecord,
    ) -> Result<Arc<TaskRecord>, GatewayError> {
        let task_id = &holder.task.id;
        self.wait_for_record(task_id, HOLDER_END_WAIT, |now| {
            let ended = now.task.status.state.is_terminal() || !now.same_holder(holder);
            ended || !self.is_running(task_id)
        })
        .await;
        self.owned_task(ctx, task_id)
    }

    /// Waits up to `limit` until the task's record meets `done`, reading
    /// it again at each of the task's events; a record that is gone ends
    /// the wait, one that cannot be read is read again at the next event.
    pub(crate) async fn wait_for_record(
        &self,
        task_id: &str,
        limit: Duration,
        done: impl Fn(&TaskRecord) -> bool,
    ) {
        // Watched before the first read: a change after it is an event.
        let mut changes = self.ledger.hub().watch_outcome(task_id);
        let waited = tokio::time::sleep(limit);
        tokio::pin!(waited);
        loop {
            match self.ledger.get_shared(task_id) {
                Ok(Some(record)) if done(&record) => return,
                Ok(None) => return,
                Ok(Some(_)) | Err(_) => {}
            }
            tokio::select! {
                change = changes.recv() => {
                    if let Err(broadcast::error::RecvError::Closed) = change {
                        changes = self.ledger.hub().watch_outcome(task_id);
                    }
                }
                () = &mut waited => return,
            }
        }
    }

    /// A task that moved on while it was being ended (a result returned to
    /// its source, a transfer, a reroute) has a holder that was not asked
    /// to cancel: it is told now, on its own, so that an unreachable agent
    /// does not hold up the caller's answer.
    fn cancel_later_holder(&self, asked: &TaskRecord, ended: &TaskRecord) {
        if !ended.same_holder(asked) {
            self.tell_holder_canceled(ended);
        }
    }

    /// Sends the holder of the task `ended` CancelTask, on its own, so that
    /// an agent slow to answer holds up nothing.
    fn tell_holder_canceled(&self, ended: &TaskRecord) {
        if let Some(agent) = self.agent(&ended.agent) {
            tell_canceled(agent, ended.task.clone(), ended.upstream.clone());
        }
    }

    /// The first steps of a gateway cancel: the task's driver is told to
    /// stop, so that a result is less likely to return to a source, then
    /// the sources waiting for its result are released.
    async fn stop_driver_and_release_sources(&self, task_id: &str) {
        if let Some(RunningTask { cancel: token, .. }) =
            self.running.lock().expect("running lock").get(task_id)
        {
            token.cancel();
        }
        self.release_paused_sources(task_id).await;
    }

    /// A source that handed the task on with `returnToParent` keeps its own
    /// task paused for the result: that task, and those of earlier sources
    /// still waiting, end with the gateway task. The record notes them
    /// released, so each gets one CancelTask whichever path ends the task
    /// first; the calls go out on their own, so that an unreachable source
    /// holds up neither the caller's answer nor the target's cancel. A task
    /// that was never handed on (as read now) costs one read, not a write.
    pub(crate) async fn release_paused_sources(&self, task_id: &str) {
        if let Ok(Some(record)) = self.ledger.get_shared(task_id)
            && record.transfer.is_none()
        {
            return;
        }
        let mut released = Vec::new();
        let marked = self
            .ledger
            .update(task_id, |record| {
                let newly = record.transfer.as_mut().and_then(|t| t.release_waiting());
                Ok::<_, GatewayError>(match newly {
                    Some(to_cancel) => {
                        released = to_cancel;
                        Change::Made(Vec::new())
                    }
                    None => Change::Unchanged,
                })
            })
            .await;
        let task = match marked {
            Ok(record) => record.task.clone(),
            Err(err) => {
                tracing::error!(task_id, %err, "could not release the sources waiting for a result");
                return;
            }
        };
        for (agent, upstream) in released {
            if let (Some(upstream), Some(source)) = (upstream, self.agent(&agent)) {
                tell_canceled(source, task.clone(), Some(upstream));
            }
        }
    }

    /// Cancels every task in the handoff graph below `task_id`, depth first;
    /// the children belong to the graph, whoever created them. Each is
    /// canceled in the ledger first, then its agent told on its own: one
    /// slow to answer holds up neither the cascade nor its record.
    async fn cancel_children(&self, task_id: &str) {
        let mut pending = match self.ledger.children(task_id) {
            Ok(children) => children,
            Err(err) => {
                tracing::error!(task_id, %err, "cannot read child tasks");
                return;
            }
        };
        let mut seen = std::collections::HashSet::new();
        while let Some(child) = pending.pop() {
            if !seen.insert(child.clone()) {
                continue;
            }
            let Ok(Some(record)) = self.ledger.get_shared(&child) else {
                continue;
            };
            if !record.task.status.state.is_terminal() {
                self.stop_driver_and_release_sources(&child).await;
                let mut made = false;
                let canceled = self
                    .ledger
                    .update(&child, |record| {
                        if record.task.status.state.is_terminal() {
                            return Ok::<_, GatewayError>(Change::Unchanged);
                        }
                        made = true;
                        let task = &record.task;
                        Ok(Change::Made(vec![driver::status_update(
                            &task.id,
                            &task.context_id,
                            TaskState::Canceled,
                            None,
                        )]))
                    })
                    .await;
                match canceled {
                    // Only a child this cancel ended; one that ended on its
                    // own has no holder left to tell.
                    Ok(ended) if made => self.tell_holder_canceled(&ended),
                    Ok(_) => {}
                    Err(err) => {
                        tracing::error!(task_id = %child, %err, "cascaded cancel not recorded");
                    }
                }
            }
            pending.extend(self.ledger.children(&child).unwrap_or_default());
        }
    }

    /// `SubscribeToTask`: the current task, then every later event.
    pub async fn subscribe(
        self: &Arc<Self>,
        ctx: &CallContext,
        req: SubscribeToTaskRequest,
    ) -> Result<TaskEventStream, GatewayError> {
        let mut violations = Vec::new();
        check_required(&req.id, "id", &mut violations);
        finish(violations)?;
        // Checked before the watch: a channel made for a task the caller
        // may not see would stay until a sweep, keyed by the caller's id.
        self.owned_task(ctx, &req.id)?;
        // Watch before reading, so no event falls between the two.
        let watcher = self.ledger.hub().watch(&req.id);
        let record = self.owned_durable_task(ctx, &req.id).await?;
        if record.task.status.state.is_terminal() {
            return Err(GatewayError::UnsupportedOperation(format!(
                "task {} is in terminal state {} and cannot be subscribed to",
                req.id,
                record.task.status.state.proto_name()
            )));
        }
        Ok(TaskEventStream::from_snapshot(
            self.clone(),
            &record,
            watcher,
            false,
        ))
    }

    /// `CreateTaskPushNotificationConfig`.
    pub async fn create_push_config(
        &self,
        ctx: &CallContext,
        mut config: TaskPushNotificationConfig,
    ) -> Result<TaskPushNotificationConfig, GatewayError> {
        self.check_push_enabled()?;
        let mut violations = Vec::new();
        check_required(&config.task_id, "taskId", &mut violations);
        self.push.check_config(&config, "", &mut violations);
        finish(violations)?;
        self.owned_task(ctx, &config.task_id)?;
        if config.id.is_empty() {
            config.id = uuid::Uuid::new_v4().to_string();
        }
        config.tenant.clear();
        self.store_push_config(&config, "taskId").await?;
        Ok(config)
    }

    /// Stores a push config unless it would be one more than a task may
    /// hold ([`crate::push::MAX_CONFIGS_PER_TASK`]; each is notified of
    /// every event): that is an invalid `field`.
    pub(crate) async fn store_push_config(
        &self,
        config: &TaskPushNotificationConfig,
        field: &str,
    ) -> Result<(), GatewayError> {
        let most = crate::push::MAX_CONFIGS_PER_TASK;
        self.ledger
            .put_push_config(config, most)
            .await?
            .map_err(|held| {
                GatewayError::invalid_field(
                    field,
                    format!(
                        "task {} holds {held} push configs, the most a task may; delete one first",
                        config.task_id
                    ),
                )
            })
    }

    /// Whether `config`'s task holds a config that is `config` but for its
    /// id (which `config` lacks).
    pub(crate) async fn holds_push_config(
        &self,
        config: &TaskPushNotificationConfig,
    ) -> Result<bool, GatewayError> {
        let held = self.ledger.push_configs(&config.task_id).await?;
        Ok(held.iter().any(|held| {
            *held
                == TaskPushNotificationConfig {
                    id: held.id.clone(),
                    ..config.clone()
                }
        }))
    }

    /// Checks a reference to one push config: push on, both ids given, and
    /// the task the caller's.
    fn check_push_ref(
        &self,
        ctx: &CallContext,
        req: &TaskPushNotificationConfigRef,
    ) -> Result<(), GatewayError> {
        self.check_push_enabled()?;
        let mut violations = Vec::new();
        check_required(&req.task_id, "taskId", &mut violations);
        check_required(&req.id, "id", &mut violations);
        finish(violations)?;
        self.owned_task(ctx, &req.task_id).map(drop)
    }

    /// `GetTaskPushNotificationConfig`.
    pub async fn get_push_config(
        &self,
        ctx: &CallContext,
        req: TaskPushNotificationConfigRef,
    ) -> Result<TaskPushNotificationConfig, GatewayError> {
        self.check_push_ref(ctx, &req)?;
        self.ledger
            .get_push_config(&req.task_id, &req.id)
            .await?
            .ok_or_else(|| GatewayError::PushConfigNotFound {
                task_id: req.task_id.clone(),
                config_id: req.id.clone(),
            })
    }

    /// `ListTaskPushNotificationConfigs`.
    pub async fn list_push_configs(
        &self,
        ctx: &CallContext,
        req: ListTaskPushNotificationConfigsRequest,
    ) -> Result<ListTaskPushNotificationConfigsResponse, GatewayError> {
        self.check_push_enabled()?;
        let mut violations = Vec::new();
        check_required(&req.task_id, "taskId", &mut violations);
        if req.page_size < 0 {
            violations.push(crate::error::FieldViolation::new(
                "pageSize",
                "must not be negative",
            ));
        }
        finish(violations)?;
        self.owned_task(ctx, &req.task_id)?;
        let configs = self.ledger.push_configs(&req.task_id).await?;
        let page_size = if req.page_size == 0 {
            validate::MAX_PAGE_SIZE
        } else {
            req.page_size
        } as usize;
        let start = if req.page_token.is_empty() {
            0
        } else {
            configs
                .iter()
                .position(|c| c.id > req.page_token)
                .unwrap_or(configs.len())
        };
        let page: Vec<_> = configs
            .iter()
            .skip(start)
            .take(page_size)
            .cloned()
            .collect();
        let next_page_token = if start + page.len() < configs.len() {
            page.last().map(|c| c.id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(ListTaskPushNotificationConfigsResponse {
            configs: page,
            next_page_token,
        })
    }

    /// `DeleteTaskPushNotificationConfig`: idempotent.
    pub async fn delete_push_config(
        &self,
        ctx: &CallContext,
        req: TaskPushNotificationConfigRef,
    ) -> Result<(), GatewayError> {
        self.check_push_ref(ctx, &req)?;
        self.ledger
            .delete_push_config(&req.task_id, &req.id)
            .await?;
        Ok(())
    }

    /// Enters a driver for `task_id`: the task's cancel token, shared by
    /// every driver on the task, so one CancelTask stops them all.
    pub(crate) fn enter_running(&self, task_id: &str) -> CancellationToken {
        let mut running = self.running.lock().expect("running lock");
        let entry = running
            .entry(task_id.to_string())
            .or_insert_with(|| RunningTask {
                cancel: self.shutdown.child_token(),
                drivers: 0,
                follower: None,
            });
        entry.drivers += 1;
        entry.cancel.clone()
    }

    /// `events` for `agent`'s execution on `task_id`, which takes the
    /// task's follow-ups from now on if the agent forwards them.
    pub(crate) fn follow_ups_to(
        &self,
        task_id: &str,
        agent: &AgentEntry,
        events: AgentEvents,
    ) -> AgentEvents {
        match self.register_follower(task_id, agent) {
            Some((follow_ups, _)) => events.with_follow_ups(follow_ups),
            None => events,
        }
    }

    /// Where `agent`'s next execution on `task_id` takes the task's
    /// follow-ups from now on, if the agent forwards them and a driver runs
    /// the task; with the follower it displaced. Dropped, the follower is
    /// gone ([`Self::follower_of`]).
    pub(crate) fn register_follower(
        &self,
        task_id: &str,
        agent: &AgentEntry,
    ) -> Option<(FollowUpReceiver, Option<RegisteredFollower>)> {
        if !agent.agent.takes_follow_ups() {
            return None;
        }
        let mut running = self.running.lock().expect("running lock");
        let entry = running.get_mut(task_id)?;
        let (sender, receiver) = mpsc::channel(FOLLOW_UP_QUEUE);
        let displaced = entry.follower.replace((agent.id.clone(), sender));
        Some((receiver, displaced))
    }

    /// Puts back the follower a registration that came to nothing (its
    /// receiver dropped) displaced, unless another registered since.
    pub(crate) fn restore_follower(&self, task_id: &str, displaced: Option<RegisteredFollower>) {
        let mut running = self.running.lock().expect("running lock");
        if let Some(entry) = running.get_mut(task_id)
            && entry
                .follower
                .as_ref()
                .is_none_or(|(_, sender)| sender.is_closed())
        {
            entry.follower = displaced;
        }
    }

    /// Where `agent`'s execution following `task_id` takes follow-ups, if
    /// one does.
    pub(crate) fn follower_of(&self, task_id: &str, agent: &str) -> Option<FollowUpSender> {
        let running = self.running.lock().expect("running lock");
        let (follower, sender) = running.get(task_id)?.follower.as_ref()?;
        (follower == agent && !sender.is_closed()).then(|| sender.clone())
    }

    /// Whether a routing rule matches `params.tenant` = `label`.
    pub fn routes_tenant(&self, label: &str) -> bool {
        self.settings.routing.names_tenant(label)
    }

    /// Whether a driver is working on the task now.
    pub(crate) fn is_running(&self, task_id: &str) -> bool {
        self.running
            .lock()
            .expect("running lock")
            .contains_key(task_id)
    }

    /// Counts a handoff from `source` to `target` at hop `hops`, whose
    /// message to the target is `bytes` long.
    pub(crate) fn metrics_handoff(
        &self,
        (source, target): (&str, &str),
        kind: store::HopKind,
        hops: u32,
        bytes: u64,
    ) {
        self.metrics.handoff_started(source, target, kind);
        self.metrics.hop_depth(hops);
        self.metrics.message_bytes(target, bytes);
    }

    /// A driver of `task_id` ends; the token goes with the last one.
    pub(crate) fn unregister_running(&self, task_id: &str) {
        let mut running = self.running.lock().expect("running lock");
        if let Some(entry) = running.get_mut(task_id) {
            entry.drivers = entry.drivers.saturating_sub(1);
            if entry.drivers == 0 {
                running.remove(task_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netguard::OutboundPolicy;
    use crate::push::PushSettings;

    fn status(state: TaskState) -> StreamResponse {
        status_of("t1", state)
    }

    /// Task `task_id` moved to `state`.
    fn status_of(task_id: &str, state: TaskState) -> StreamResponse {
        StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: task_id.into(),
            context_id: "c1".into(),
            status: TaskStatus::now(state, None),
            ..TaskStatusUpdateEvent::default()
        })
    }

    /// A gateway over `ledger` with the built-in agents.
    fn gateway_over(ledger: &Arc<Ledger>) -> Arc<Gateway> {
        let push =
            PushDispatcher::start(ledger, OutboundPolicy::default(), PushSettings::default());
        let directory = Arc::new(Directory::new("http://localhost", false));
        for handle in crate::agents::builtin_agents() {
            let policy = crate::registry::directory::AgentPolicy::default();
            directory.upsert(
                &handle.id,
                "local",
                handle.agent,
                policy,
                chrono::Utc::now(),
            );
        }
        let settings = GatewaySettings::default();
        Gateway::new(
            ledger.clone(),
            directory,
            push,
            settings,
            CancellationToken::new(),
        )
    }

    /// A ledger in `dir` and a gateway over it.
    fn open_gateway(dir: &std::path::Path) -> (Arc<Ledger>, Arc<Gateway>) {
        let ledger = Arc::new(Ledger::open(dir).unwrap());
        let gateway = gateway_over(&ledger);
        (ledger, gateway)
    }

    /// A user's message saying "hi".
    fn hi(message_id: &str) -> Message {
        Message {
            message_id: message_id.into(),
            role: Role::User,
            parts: vec![Part::text("hi")],
            ..Message::default()
        }
    }

    /// Waits, at most 5 s, until `noted` holds: a write noted but held
    /// from the log is readable at once.
    async fn until_noted(mut noted: impl FnMut() -> bool) {
        let wait = async {
            while !noted() {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("the write is noted");
    }

    /// alice's task `t1`, WORKING at the echo agent, durable.
    async fn alices_working_task(ledger: &Ledger) {
        alices_task(ledger, TaskState::Working).await;
    }

    /// alice's task `t1`, in `state` at the echo agent, durable.
    async fn alices_task(ledger: &Ledger, state: TaskState) {
        alices_task_named(ledger, "t1", state).await;
    }

    /// alice's task `id`, in `state` at the echo agent, durable.
    async fn alices_task_named(ledger: &Ledger, id: &str, state: TaskState) {
        let record = TaskRecord {
            task: Task {
                id: id.into(),
                context_id: "c1".into(),
                ..Task::default()
            },
            owner: "alice".into(),
            agent: "echo".into(),
            ..TaskRecord::default()
        };
        ledger
            .create(record, vec![status_of(id, state)])
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_record_that_does_not_decode_leaves_the_other_tasks_recovered() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        for id in ["t1", "t2", "t3"] {
            alices_task_named(&ledger, id, TaskState::Working).await;
        }
        ledger.damage_record("t2");
        drop(gateway);
        drop(ledger);
        // Read back from disk, as at a start-up.
        let (ledger, gateway) = open_gateway(dir.path());
        let recovered = gateway.recover_in_flight().await.expect("start-up goes on");
        assert_eq!(recovered, 2, "every task but the damaged one");
        assert!(ledger.get("t2").is_err_and(|err| err.is_corrupt()));
    }

    /// Completes `t1` in a task of its own, which ends once the write is
    /// durable.
    fn complete_in_background(
        ledger: &Arc<Ledger>,
    ) -> tokio::task::JoinHandle<Result<Arc<TaskRecord>, LedgerError>> {
        let ledger = ledger.clone();
        tokio::spawn(async move {
            let completed = vec![status(TaskState::Completed)];
            ledger
                .update("t1", |_| Ok::<_, LedgerError>(completed))
                .await
        })
    }

    /// Holds the log and completes `t1` behind it: the COMPLETED state is
    /// noted (readable) but not durable until the hold is dropped.
    async fn completed_behind_held_log(
        ledger: &Arc<Ledger>,
    ) -> (
        crate::store::flusher::LogHold,
        tokio::task::JoinHandle<Result<Arc<TaskRecord>, LedgerError>>,
    ) {
        let hold = ledger.hold_log();
        let writer = complete_in_background(ledger);
        until_noted(|| {
            ledger.get("t1").unwrap().unwrap().task.status.state == TaskState::Completed
        })
        .await;
        (hold, writer)
    }

    /// `answer`'s error as JSON-RPC, which must come within `limit` (not
    /// wait on the log) and be -32603 LEDGER_UNAVAILABLE.
    async fn ledger_unavailable<T: std::fmt::Debug>(
        answer: impl std::future::Future<Output = Result<T, GatewayError>>,
        limit: Duration,
    ) -> serde_json::Value {
        let err = tokio::time::timeout(limit, answer)
            .await
            .expect("failed at once, not left waiting on the log")
            .unwrap_err();
        assert!(matches!(err, GatewayError::LedgerUnavailable(_)), "{err:?}");
        let rpc = err.to_rpc_error();
        assert_eq!(rpc["code"], -32603);
        assert_eq!(rpc["data"][0]["reason"], "LEDGER_UNAVAILABLE");
        rpc
    }

    /// Whether `answer` is still pending after 100 ms.
    async fn still_waiting(answer: impl std::future::Future) -> bool {
        tokio::time::timeout(Duration::from_millis(100), answer)
            .await
            .is_err()
    }

    /// alice calling `echo`, with `idempotency_key`.
    fn alice(idempotency_key: Option<&str>) -> CallContext {
        CallContext {
            principal: "alice".into(),
            agent_id: "echo".into(),
            idempotency_key: idempotency_key.map(str::to_string),
            incoming: Default::default(),
            pinned: true,
            extensions: Vec::new(),
            tenant_label: None,
        }
    }

    fn state_of(reply: &impl serde::Serialize) -> String {
        let json = serde_json::to_value(reply).unwrap();
        json["status"]["state"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// A named sender that a guarded target checks: another agency's
    /// retired agent is refused, the caller's own passes, and one whose
    /// record cannot be read fails the send instead of passing unchecked.
    #[tokio::test]
    async fn a_sender_the_ledger_cannot_read_fails_the_allow_list_check() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let guarded = guard_with_retired_senders(&ledger, &gateway).await;

        let check =
            |source| gateway.claimed_source_refusal("alice", Some(source), Some(&guarded), None);
        let (reason, _) = check("globex-old")
            .unwrap()
            .expect("another agency's agent");
        assert_eq!(reason, crate::handoff::reasons::NOT_ALLOWED);
        assert!(
            check("alice-old").unwrap().is_none(),
            "the caller's own agent"
        );
        assert!(check("torn").is_err(), "an unreadable record must not pass");
    }

    /// A subscription the caller may not make leaves no channel behind:
    /// the id is the caller's, and a channel stays until a sweep.
    #[tokio::test]
    async fn a_refused_subscription_watches_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let request = SendMessageRequest {
            message: Some(hi("m1")),
            ..SendMessageRequest::default()
        };
        let reply = gateway.send_message(&alice(None), request).await.unwrap();
        let task_id = serde_json::to_value(&reply).unwrap()["task"]["id"]
            .as_str()
            .unwrap()
            .to_string();
        let bob = CallContext {
            principal: "bob".into(),
            ..alice(None)
        };
        for (ctx, id) in [(&bob, task_id.clone()), (&alice(None), "x".repeat(4096))] {
            let request = SubscribeToTaskRequest {
                id,
                ..SubscribeToTaskRequest::default()
            };
            let refused = gateway.subscribe(ctx, request).await.err();
            assert!(
                matches!(refused, Some(GatewayError::TaskNotFound(_))),
                "{:?}",
                refused.map(|err| err.to_string())
            );
        }
        assert_eq!(ledger.hub().watched_tasks(), 0);
    }

    /// While the log cannot append, a send is refused before its agent
    /// runs (-32603, LEDGER_UNAVAILABLE), and served again once it can.
    #[tokio::test]
    async fn a_send_while_the_log_fails_is_refused_before_its_agent_runs() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let fault = ledger.fail_log(std::io::ErrorKind::StorageFull);
        // The log finds out at its next append.
        let pending = tokio::spawn({
            let ledger = ledger.clone();
            async move { ledger.put_raw(b"probe".to_vec(), b"1".to_vec()).await }
        });
        ledger.until_log_fails().await;

        let request = || SendMessageRequest {
            message: Some(hi("m1")),
            ..SendMessageRequest::default()
        };
        let ctx = alice(None);
        let refused = gateway.send_message(&ctx, request());
        let rpc = ledger_unavailable(refused, Duration::from_secs(2)).await;
        let message = rpc["message"].as_str().unwrap();
        assert!(message.contains("cannot make writes durable"), "{message}");
        assert!(message.contains("not started"), "{message}");

        drop(fault);
        tokio::time::timeout(Duration::from_secs(5), pending)
            .await
            .expect("the noted write is durable once the log appends")
            .unwrap()
            .unwrap();
        let listed = ledger.list("alice", &store::ListQuery::default()).unwrap();
        assert_eq!(listed.total_size, 0, "the refused send made no task");
        let reply = gateway.send_message(&ctx, request()).await.unwrap();
        let SendReply::Task(task) = reply else {
            panic!("a task, not a message")
        };
        assert_eq!(state_of(&task), "TASK_STATE_COMPLETED");
        ledger.close();
    }

    /// While sled fails, a new send is refused, but a repeat of an
    /// idempotent one is answered from the ledger: it writes nothing.
    #[tokio::test]
    async fn an_idempotent_repeat_is_answered_while_sled_fails() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let request = || SendMessageRequest {
            message: Some(hi("m1")),
            ..SendMessageRequest::default()
        };
        let keyed = alice(Some("key-1"));
        let SendReply::Task(first) = gateway.send_message(&keyed, request()).await.unwrap() else {
            panic!("a task, not a message")
        };

        let fault = ledger.fail_sled(std::io::ErrorKind::Other);
        ledger
            .put_raw(b"probe".to_vec(), b"1".to_vec())
            .await
            .unwrap();
        ledger.until_sled_fails().await;

        let SendReply::Task(repeat) = gateway.send_message(&keyed, request()).await.unwrap() else {
            panic!("a task, not a message")
        };
        let id = |reply: &TaskReply| serde_json::to_value(reply).unwrap()["id"].clone();
        assert_eq!(id(&repeat), id(&first), "the first send's task");
        let unkeyed = alice(None);
        let fresh = gateway.send_message(&unkeyed, request());
        let rpc = ledger_unavailable(fresh, Duration::from_secs(2)).await;
        let message = rpc["message"].as_str().unwrap();
        assert!(message.contains("cannot apply writes to sled"), "{message}");
        drop(fault);
        ledger.close();
    }

    /// While the log cannot append, a read that would show a write still
    /// waiting on it fails (LEDGER_UNAVAILABLE) instead of waiting with
    /// it, and answers once the log writes again.
    #[tokio::test]
    async fn a_read_waiting_on_a_failing_log_fails_instead_of_hanging() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        alices_working_task(&ledger).await;
        let fault = ledger.fail_log(std::io::ErrorKind::StorageFull);
        let writer = complete_in_background(&ledger);
        ledger.until_log_fails().await;
        let ctx = alice(None);
        let get = || {
            gateway.get_task(
                &ctx,
                GetTaskRequest {
                    id: "t1".into(),
                    ..GetTaskRequest::default()
                },
            )
        };

        ledger_unavailable(get(), Duration::from_secs(2)).await;
        let listed = gateway.list_tasks(&ctx, ListTasksRequest::default());
        ledger_unavailable(listed, Duration::from_secs(2)).await;

        drop(fault);
        writer.await.unwrap().unwrap();
        assert_eq!(state_of(&get().await.unwrap()), "TASK_STATE_COMPLETED");
        ledger.close();
    }

    /// bob's echo agent as `guarded`, taking handoffs from `globex-old`
    /// and `alice-old` (deregistered by globex and by alice) and from
    /// `torn`, whose retired record does not decode.
    async fn guard_with_retired_senders(ledger: &Ledger, gateway: &Gateway) -> Arc<AgentEntry> {
        let echo = gateway.agent("echo").unwrap().agent.clone();
        let policy = crate::registry::directory::AgentPolicy {
            allow_from: Some(vec!["globex-old".into(), "alice-old".into(), "torn".into()]),
            ..Default::default()
        };
        let guarded =
            gateway
                .directory()
                .upsert("guarded", "bob", echo, policy, chrono::Utc::now());
        ledger.delete_agent("globex-old", "globex").await.unwrap();
        ledger.delete_agent("alice-old", "alice").await.unwrap();
        let torn = crate::store::keys::retired_agent("torn");
        ledger.put_raw(torn, b"{\"not".to_vec()).await.unwrap();
        guarded
    }

    /// A send that fails on such a sender takes back what it stored: its
    /// idempotency key (the same send is served anew once the record
    /// reads), and the push config it gave for the task it never made.
    #[tokio::test]
    async fn a_send_failing_on_an_unreadable_sender_takes_back_its_key_and_push_config() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        guard_with_retired_senders(&ledger, &gateway).await;
        let ctx = CallContext {
            agent_id: "guarded".into(),
            ..alice(Some("k1"))
        };
        let send: SendMessageRequest = serde_json::from_value(serde_json::json!({
            "message": {
                "messageId": "m1",
                "role": "ROLE_USER",
                "parts": [{"text": "hi"}],
                "metadata": {crate::protocol::HANDOFF_EXTENSION: {"chain": ["torn"]}},
            },
            "configuration": {
                "taskPushNotificationConfig": {"url": "https://hooks.example.com/baton"},
            },
        }))
        .unwrap();
        let stored_configs = ledger.push_config_count();

        let err = gateway.send_message(&ctx, send.clone()).await.unwrap_err();
        assert!(matches!(err, GatewayError::Internal(_)), "{err:?}");
        assert_eq!(stored_configs.load(std::sync::atomic::Ordering::Relaxed), 0);

        let torn = crate::store::keys::retired_agent("torn");
        ledger.put_raw(torn, b"\"alice\"".to_vec()).await.unwrap();
        let reply = gateway.send_message(&ctx, send).await.unwrap();
        let SendReply::Task(task) = reply else {
            panic!("a task, not a message")
        };
        assert_eq!(state_of(&task), "TASK_STATE_COMPLETED");
        assert_eq!(stored_configs.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    /// An agent that cannot be reached: every send fails before a task exists.
    struct DownAgent(AgentCard);

    #[async_trait::async_trait]
    impl crate::agents::Agent for DownAgent {
        fn card(&self) -> &AgentCard {
            &self.0
        }

        async fn execute(
            &self,
            _request: crate::agents::AgentRequest,
            _events: crate::agents::AgentEvents,
        ) -> Result<(), crate::agents::AgentError> {
            Err(crate::agents::AgentError::Unreachable("down".into()))
        }
    }

    /// An agent made with the echo agent's card, registered as alice's `id`.
    fn register_alices<A: crate::agents::Agent>(
        gateway: &Arc<Gateway>,
        id: &str,
        make: impl FnOnce(AgentCard) -> A,
    ) -> Arc<A> {
        let card = gateway.agent("echo").unwrap().agent.card().clone();
        let agent = Arc::new(make(card));
        let policy = crate::registry::directory::AgentPolicy::default();
        let now = chrono::Utc::now();
        gateway
            .directory()
            .upsert(id, "alice", agent.clone(), policy, now);
        agent
    }

    /// A way to send alice's messages to `agent_id`, each on a task of its
    /// own (blocking unless `return_immediately`).
    fn alices_sends(
        gateway: &Arc<Gateway>,
        agent_id: &str,
        return_immediately: bool,
    ) -> impl Fn(Message) -> tokio::task::JoinHandle<Result<SendReply, GatewayError>> {
        let ctx = CallContext {
            agent_id: agent_id.into(),
            ..alice(None)
        };
        let gateway = gateway.clone();
        move |message| {
            let (gateway, ctx) = (gateway.clone(), ctx.clone());
            let request = SendMessageRequest {
                message: Some(message),
                configuration: Some(SendMessageConfiguration {
                    return_immediately,
                    ..SendMessageConfiguration::default()
                }),
                ..SendMessageRequest::default()
            };
            tokio::spawn(async move { gateway.send_message(&ctx, request).await })
        }
    }

    /// The id of the task a send replied with.
    fn task_id_of(reply: SendReply) -> String {
        let SendReply::Task(task) = reply else {
            panic!("a task, not a message")
        };
        serde_json::to_value(&task).unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// An agent that reports `e1`, then, once `go` is told, `e2` and a
    /// moment later `a1`; then it takes a follow-up, forwarding it after its
    /// events are handled as an upstream execution does, and completes.
    struct ReportingAgent {
        card: AgentCard,
        go: tokio::sync::Notify,
    }

    #[async_trait::async_trait]
    impl crate::agents::Agent for ReportingAgent {
        fn card(&self) -> &AgentCard {
            &self.card
        }

        fn takes_follow_ups(&self) -> bool {
            true
        }

        async fn execute(
            &self,
            _request: crate::agents::AgentRequest,
            mut events: crate::agents::AgentEvents,
        ) -> Result<(), crate::agents::AgentError> {
            let said = |text: &str| Some(Message::agent(vec![Part::text(text)]));
            events.status(TaskState::Working, said("e1")).await;
            self.go.notified().await;
            events.status(TaskState::Working, said("e2")).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            events.status(TaskState::Working, said("a1")).await;
            let mut follow_ups = events.take_follow_ups().expect("follow-ups");
            let follow_up = follow_ups.recv().await.expect("a follow-up");
            events.until_handled(3).await;
            let _ = follow_up.taken.send(Ok(()));
            let _ = follow_up.recorded.await;
            events.status(TaskState::Completed, None).await;
            Ok(())
        }
    }

    /// A follow-up an execution forwards once its events are handled is
    /// written after them, also after one still queued behind a write that
    /// waits for the log: the follow-up's write came first.
    #[tokio::test]
    async fn a_follow_up_is_written_after_the_events_reported_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let agent = register_alices(&gateway, "reporter", |card| ReportingAgent {
            card,
            go: tokio::sync::Notify::new(),
        });
        let send = alices_sends(&gateway, "reporter", true);
        let task_id = task_id_of(send(hi("m1")).await.unwrap().unwrap());
        let texts = || {
            let record = ledger.get(&task_id).unwrap().unwrap();
            let history = record.task.history.iter();
            let texts = history.filter_map(|m| m.parts.first()?.as_text().map(str::to_string));
            texts.collect::<Vec<_>>()
        };
        until_noted(|| texts().len() == 2).await;

        let hold = ledger.hold_log();
        agent.go.notify_one();
        until_noted(|| texts().len() == 3).await;
        let follow_up = send(Message {
            task_id: task_id.clone(),
            ..hi("f2")
        });
        // Time for the follow-up's write to go first, if it may.
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(hold);
        let written = tokio::time::timeout(Duration::from_secs(5), follow_up).await;
        written.expect("the follow-up is written").unwrap().unwrap();
        until_noted(|| {
            ledger
                .get(&task_id)
                .unwrap()
                .unwrap()
                .task
                .status
                .state
                .is_terminal()
        })
        .await;
        assert_eq!(texts(), ["hi", "e1", "e2", "a1", "hi"]);
        ledger.close();
    }

    /// A registration that came to nothing gives the task back the
    /// follower it displaced, unless another registered since.
    #[tokio::test]
    async fn a_follower_displaced_for_nothing_is_restored() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        register_alices(&gateway, "keeper", |card| FollowingAgent {
            card,
            executions: Default::default(),
            follow_ups: Mutex::default(),
        });
        let keeper = gateway.agent("keeper").unwrap();
        gateway.enter_running("t1");
        let (_first, none) = gateway.register_follower("t1", &keeper).unwrap();
        assert!(none.is_none());
        let (second, displaced) = gateway.register_follower("t1", &keeper).unwrap();
        drop(second);
        gateway.restore_follower("t1", displaced);
        assert!(gateway.follower_of("t1", "keeper").is_some(), "restored");

        let (third, displaced) = gateway.register_follower("t1", &keeper).unwrap();
        let (mut fourth, _) = gateway.register_follower("t1", &keeper).unwrap();
        drop(third);
        gateway.restore_follower("t1", displaced);
        let live = gateway.follower_of("t1", "keeper").unwrap();
        let (taken, _) = tokio::sync::oneshot::channel();
        let (_, recorded) = tokio::sync::oneshot::channel();
        let follow_up = crate::agents::FollowUp {
            message: hi("m"),
            accepted_output_modes: Vec::new(),
            answers: None,
            taken,
            recorded,
        };
        live.try_send(Box::new(follow_up)).unwrap();
        assert!(
            fourth.try_recv().is_ok(),
            "the one registered since follows on"
        );
        ledger.close();
    }

    /// An agent that follows its tasks: a first message is asked for input;
    /// an answer's execution takes a follow-up if one comes within 2 s,
    /// then completes the task. It counts its executions and the
    /// follow-ups it took.
    struct FollowingAgent {
        card: AgentCard,
        executions: std::sync::atomic::AtomicUsize,
        follow_ups: Mutex<Vec<String>>,
    }

    #[async_trait::async_trait]
    impl crate::agents::Agent for FollowingAgent {
        fn card(&self) -> &AgentCard {
            &self.card
        }

        fn takes_follow_ups(&self) -> bool {
            true
        }

        async fn execute(
            &self,
            request: crate::agents::AgentRequest,
            mut events: crate::agents::AgentEvents,
        ) -> Result<(), crate::agents::AgentError> {
            use std::sync::atomic::Ordering;
            self.executions.fetch_add(1, Ordering::SeqCst);
            if request.task.is_none() {
                events.status(TaskState::InputRequired, None).await;
                return Ok(());
            }
            events.status(TaskState::Working, None).await;
            // The follow-up the test sends, if it comes here.
            if let Some(mut follow_ups) = events.take_follow_ups()
                && let Ok(Some(follow_up)) =
                    tokio::time::timeout(Duration::from_secs(2), follow_ups.recv()).await
            {
                let id = follow_up.message.message_id.clone();
                self.follow_ups.lock().unwrap().push(id);
                let _ = follow_up.taken.send(Ok(()));
            }
            events.status(TaskState::Completed, None).await;
            Ok(())
        }
    }

    /// A message to a task its answer made WORKING again, while that write
    /// waits to be durable, goes to the answer's execution as a follow-up:
    /// it started a second execution of the agent on the task (the
    /// follower was registered only once the write was durable).
    #[tokio::test]
    async fn a_message_to_a_task_just_resumed_is_a_follow_up() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let agent = register_alices(&gateway, "keeper", |card| FollowingAgent {
            card,
            executions: Default::default(),
            follow_ups: Mutex::default(),
        });
        let send = alices_sends(&gateway, "keeper", false);
        let task_id = task_id_of(send(hi("m1")).await.unwrap().unwrap());
        let on_task = |message_id: &str| Message {
            task_id: task_id.clone(),
            ..hi(message_id)
        };

        let hold = ledger.hold_log();
        let answer = send(on_task("m2"));
        until_noted(|| {
            let record = ledger.get(&task_id).unwrap().unwrap();
            record.task.status.state == TaskState::Working
        })
        .await;
        let follow_up = send(on_task("m3"));
        // Time for the message to start an execution of its own, if it may.
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(hold);
        answer.await.unwrap().unwrap();
        follow_up.await.unwrap().unwrap();
        let executions = agent.executions.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(executions, 2, "the first message's, the answer's");
        assert_eq!(*agent.follow_ups.lock().unwrap(), ["m3"]);
        ledger.close();
    }

    /// A send whose agent fails before any task exists takes back the push
    /// config it stored for that task, as it does its idempotency key.
    #[tokio::test]
    async fn a_send_whose_agent_fails_before_a_task_takes_back_its_push_config() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let card = gateway.agent("echo").unwrap().agent.card().clone();
        let policy = crate::registry::directory::AgentPolicy::default();
        let down = Arc::new(DownAgent(card));
        gateway
            .directory()
            .upsert("down", "alice", down, policy, chrono::Utc::now());
        let ctx = CallContext {
            agent_id: "down".into(),
            ..alice(Some("k-down"))
        };
        let send: SendMessageRequest = serde_json::from_value(serde_json::json!({
            "message": {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "hi"}]},
            "configuration": {
                "taskPushNotificationConfig": {"url": "https://hooks.example.com/baton"},
            },
        }))
        .unwrap();
        let stored_configs = ledger.push_config_count();
        for _ in 0..2 {
            let err = gateway.send_message(&ctx, send.clone()).await.unwrap_err();
            assert!(
                matches!(err, GatewayError::UpstreamUnreachable { .. }),
                "{err:?}"
            );
            assert_eq!(stored_configs.load(std::sync::atomic::Ordering::Relaxed), 0);
        }
        ledger.close();
    }

    /// A user's handoff to whichever agent has skill `echo`.
    fn to_skill_echo(message_id: &str) -> Message {
        let mut part = Part::data(serde_json::json!({
            "handoffId": "h1", "from": "client", "toSkill": "echo",
            "reason": "specialization", "goal": "Echo it.", "summary": "s",
        }));
        part.media_type = crate::handoff::payload::HANDOFF_MEDIA_TYPE.to_string();
        Message {
            message_id: message_id.into(),
            role: Role::User,
            parts: vec![part],
            ..Message::default()
        }
    }

    /// A repeat is compared with the first send by what its caller sent,
    /// not by the agent the skill picked, which takes turns.
    #[tokio::test]
    async fn an_idempotent_repeat_of_a_balanced_handoff_is_answered_like_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let echo = gateway.agent("echo").unwrap().agent.clone();
        for id in ["echo-1", "echo-2"] {
            let now = chrono::Utc::now();
            gateway
                .directory()
                .upsert(id, "local", echo.clone(), Default::default(), now);
        }
        let ctx = CallContext {
            pinned: false,
            ..alice(Some("k1"))
        };
        let send = || SendMessageRequest {
            message: Some(to_skill_echo("m1")),
            ..SendMessageRequest::default()
        };
        let task_id = |reply: SendReply| match reply {
            SendReply::Task(task) => serde_json::to_value(&task).unwrap()["id"].clone(),
            SendReply::Message(_) => panic!("a task, not a message"),
        };
        let first = task_id(gateway.send_message(&ctx, send()).await.unwrap());
        let repeat = task_id(gateway.send_message(&ctx, send()).await.unwrap());
        assert_eq!(repeat, first);
        ledger.close();
    }

    /// A claim stored by a build that took the fingerprint of the agent a
    /// send was resolved to (here the task's holder, not the agent the
    /// repeat addresses) still answers the repeat.
    #[tokio::test]
    async fn a_claim_fingerprinted_by_an_older_build_still_answers_its_repeat() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let mut message = hi("m-again");
        message.task_id = "t1".into();
        message.context_id = "c1".into();
        // The first send's message is in the task it continued.
        alices_task(&ledger, TaskState::Completed).await;
        ledger
            .update("t1", |record: &mut TaskRecord| {
                record.task.history.push(message.clone());
                Ok::<_, LedgerError>(Vec::new())
            })
            .await
            .unwrap();
        let older = store::IdempotencyRecord {
            fingerprint: send::fingerprint("echo", &message),
            task_id: "t1".into(),
            message: None,
            // An older build's claim, as a restart leaves it.
            claimed_by: 0,
            history_from: None,
            claim_number: 0,
        };
        let claimed = ledger.claim_idempotency("alice", "k-old", &older).await;
        assert!(claimed.unwrap().is_none());

        let ctx = CallContext {
            agent_id: "scenario".into(),
            ..alice(Some("k-old"))
        };
        let send = SendMessageRequest {
            message: Some(message),
            ..SendMessageRequest::default()
        };
        let SendReply::Task(task) = gateway.send_message(&ctx, send).await.unwrap() else {
            panic!("a task, not a message");
        };
        assert_eq!(serde_json::to_value(&task).unwrap()["id"], "t1");
        ledger.close();
    }

    /// alice's keyed answer `message_id` to task `t1`, and the claim its
    /// first send would have stored, by the ledger opening `claimed_by`.
    fn keyed_answer(
        message_id: &str,
        claimed_by: u64,
    ) -> (SendMessageRequest, store::IdempotencyRecord) {
        let request = answer_to_t1(message_id);
        let claim = store::IdempotencyRecord {
            fingerprint: send::fingerprint("echo", request.message.as_ref().unwrap()),
            task_id: "t1".into(),
            message: None,
            claimed_by,
            history_from: None,
            claim_number: 0,
        };
        (request, claim)
    }

    /// alice's answer `message_id` to her task `t1`.
    fn answer_to_t1(message_id: &str) -> SendMessageRequest {
        let mut message = hi(message_id);
        message.task_id = "t1".into();
        SendMessageRequest {
            message: Some(message),
            ..SendMessageRequest::default()
        }
    }

    /// The messageIds in task `t1`'s history, in order.
    fn history_of_t1(ledger: &Ledger) -> Vec<String> {
        let task = ledger.get("t1").unwrap().unwrap().task;
        task.history.into_iter().map(|m| m.message_id).collect()
    }

    /// alice's task `t1` waiting for input, and the claim of her keyed
    /// answer "a-1" by the ledger opening `claimed_by`. With `reused`, the
    /// task holds a message "a-1" already, from before the claim: a
    /// messageId may be reused.
    async fn t1_and_a_keyed_answer(
        ledger: &Ledger,
        reused: bool,
        claimed_by: u64,
    ) -> (SendMessageRequest, store::IdempotencyRecord) {
        alices_task(ledger, TaskState::InputRequired).await;
        let (request, mut claim) = keyed_answer("a-1", claimed_by);
        if reused {
            ledger
                .update("t1", |record: &mut TaskRecord| {
                    record.task.history.push(hi("a-1"));
                    Ok::<_, LedgerError>(Vec::new())
                })
                .await
                .unwrap();
            claim.history_from = Some(1);
        }
        (request, claim)
    }

    /// What `t1`'s history holds once the answer of
    /// [`t1_and_a_keyed_answer`] is in.
    fn answered(reused: bool) -> &'static [&'static str] {
        if reused { &["a-1", "a-1"] } else { &["a-1"] }
    }

    /// A keyed answer whose first send a crash stopped before the task took
    /// it is taken up by its repeat after the restart, not answered with
    /// the task still waiting, the answer lost; also when it reuses a
    /// messageId the task holds.
    #[tokio::test]
    async fn a_keyed_answer_a_crash_kept_from_its_task_runs_on_its_repeat() {
        for reused in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let (ledger, gateway) = open_gateway(dir.path());
            let (repeat, claim) = t1_and_a_keyed_answer(&ledger, reused, 0).await;
            let claimed = ledger.claim_idempotency("alice", "k-answer", &claim).await;
            assert!(claimed.unwrap().is_none());

            let ctx = alice(Some("k-answer"));
            gateway.send_message(&ctx, repeat).await.unwrap();
            assert_eq!(history_of_t1(&ledger), answered(reused));
            ledger.close();
        }
    }

    /// A repeat of a keyed answer still on its way into the task waits for
    /// it, rather than answering with the task as it was before; also when
    /// it reuses a messageId the task holds.
    #[tokio::test]
    async fn a_repeated_keyed_answer_waits_until_its_task_took_it() {
        for reused in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let (ledger, gateway) = open_gateway(dir.path());
            let (mut repeat, claim) =
                t1_and_a_keyed_answer(&ledger, reused, ledger.instance()).await;
            let answer = repeat.message.clone().unwrap();
            // No agent drives the task here: the replay is not to wait for its end.
            repeat.configuration = Some(SendMessageConfiguration {
                return_immediately: true,
                ..SendMessageConfiguration::default()
            });
            let claimed = ledger.claim_idempotency("alice", "k-answer", &claim).await;
            assert!(claimed.unwrap().is_none());

            let ctx = alice(Some("k-answer"));
            let replay = gateway.send_message(&ctx, repeat);
            tokio::pin!(replay);
            assert!(
                still_waiting(&mut replay).await,
                "answered before the task took it"
            );
            // The first send's answer reaches the task.
            ledger
                .update("t1", |record: &mut TaskRecord| {
                    record.task.history.push(answer);
                    Ok::<_, LedgerError>(vec![status_of("t1", TaskState::Working)])
                })
                .await
                .unwrap();
            let SendReply::Task(task) = replay.await.unwrap() else {
                panic!("a task, not a message");
            };
            let task = serde_json::to_value(&task).unwrap();
            assert!(task["history"].to_string().contains("a-1"), "{task}");
            assert_eq!(history_of_t1(&ledger), answered(reused));
            ledger.close();
        }
    }

    /// A repeat waiting on a claim that is let go and claimed again by a
    /// send of another message is not answered with that send's task: it
    /// is refused as a key used for another message.
    #[tokio::test]
    async fn a_repeat_is_not_answered_by_another_messages_later_claim() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let claim_of = |message: &Message, task_id: &str| store::IdempotencyRecord {
            fingerprint: send::fingerprint("echo", message),
            task_id: task_id.into(),
            message: None,
            claimed_by: ledger.instance(),
            history_from: None,
            claim_number: 0,
        };
        let (first, other) = (hi("m-first"), hi("m-other"));
        let first_claim = claim_of(&first, "t-never");
        assert!(
            ledger
                .claim_idempotency("alice", "k", &first_claim)
                .await
                .unwrap()
                .is_none()
        );
        let ctx = alice(Some("k"));
        let request = SendMessageRequest {
            message: Some(first),
            ..SendMessageRequest::default()
        };
        let repeat = gateway.send_message(&ctx, request);
        tokio::pin!(repeat);
        assert!(still_waiting(&mut repeat).await);

        // The first send lets go; a send of another message takes the key.
        // Both logged in one poll: the repeat's send, a task of its own,
        // must not see the key free while the release waits on the log
        // (it would claim the key itself).
        let other_claim = claim_of(&other, "t1");
        let (released, claimed) = futures::join!(
            ledger.release_idempotency_if("alice", "k", &first_claim),
            ledger.claim_idempotency("alice", "k", &other_claim)
        );
        assert!(released.unwrap());
        assert!(claimed.unwrap().is_none());
        alices_task(&ledger, TaskState::Completed).await;
        let refused = repeat.await.expect_err("not the other message's task");
        assert!(
            matches!(refused, GatewayError::InvalidParams { .. }),
            "{refused:?}"
        );
        ledger.close();
    }

    /// A task waiting for input fails at its deadline also when its agent
    /// was deregistered meanwhile (it is sent no CancelTask then).
    #[tokio::test]
    async fn a_waiting_task_whose_agent_left_still_fails_at_its_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let mut ctx = CallContext {
            agent_id: "scenario".into(),
            ..alice(None)
        };
        // Room for the send's own log syncs on a slow machine.
        ctx.incoming.deadline = Some(chrono::Utc::now() + chrono::Duration::seconds(2));
        let send = SendMessageRequest {
            message: Some(hi("tck-input-required-1")),
            ..SendMessageRequest::default()
        };
        let SendReply::Task(task) = gateway.send_message(&ctx, send).await.unwrap() else {
            panic!("a task, not a message");
        };
        assert_eq!(state_of(&task), "TASK_STATE_INPUT_REQUIRED");
        let task_id = serde_json::to_value(&task).unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        gateway.directory().remove("scenario");

        store::until("the task fails at its deadline", || {
            let record = ledger.get(&task_id).unwrap().unwrap();
            (record.task.status.state == TaskState::Failed).then_some(())
        })
        .await;
        ledger.close();
    }

    /// A hop count at its clamp is refused as over the limit; counting the
    /// refused delivery's hop does not overflow.
    #[tokio::test]
    async fn a_hop_count_at_its_clamp_is_rejected_without_overflow() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let mut ctx = alice(None);
        ctx.incoming.hops = Some(u32::MAX);
        let send = SendMessageRequest {
            message: Some(hi("m1")),
            ..SendMessageRequest::default()
        };
        let SendReply::Task(task) = gateway.send_message(&ctx, send).await.unwrap() else {
            panic!("a task, not a message");
        };
        assert_eq!(state_of(&task), "TASK_STATE_REJECTED");
        let task = serde_json::to_value(&task).unwrap();
        assert!(task.to_string().contains("HOP_LIMIT_EXCEEDED"), "{task}");
        ledger.close();
    }

    /// A write is readable before it is durable (the overlay has it at
    /// once), but GetTask shows it only once it is. (A listing waits for
    /// the writes pending when it starts to be applied, durable first.)
    #[tokio::test]
    async fn replies_show_a_write_only_once_it_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        alices_working_task(&ledger).await;
        let ctx = alice(None);

        let (hold, writer) = completed_behind_held_log(&ledger).await;
        let get = gateway.get_task(
            &ctx,
            GetTaskRequest {
                id: "t1".into(),
                ..GetTaskRequest::default()
            },
        );
        tokio::pin!(get);
        assert!(still_waiting(&mut get).await, "GetTask waited");

        drop(hold);
        assert_eq!(state_of(&get.await.unwrap()), "TASK_STATE_COMPLETED");
        writer.await.unwrap().unwrap();
        ledger.close();
    }

    /// Two answers to one question at once: the first resumes the task, the
    /// second is refused (-32004) rather than starting a second turn.
    #[tokio::test]
    async fn of_two_answers_to_one_question_only_the_first_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        alices_task(&ledger, TaskState::InputRequired).await;
        let ctx = alice(None);
        // Both read the task as asking before either driver runs.
        let (first, second) = tokio::join!(
            gateway.send_message(&ctx, answer_to_t1("a-1")),
            gateway.send_message(&ctx, answer_to_t1("a-2")),
        );
        assert!(first.is_ok(), "{:?}", first.err());
        let refused = second.expect_err("the second answer refused");
        assert!(
            matches!(&refused, GatewayError::UnsupportedOperation(why) if why.contains("another answer")),
            "{refused:?}"
        );
        let ids = history_of_t1(&ledger);
        assert!(
            ids.contains(&"a-1".into()) && !ids.contains(&"a-2".into()),
            "{ids:?}"
        );
        ledger.close();
    }

    /// A deadline that passes while a driver is on the task (its last turn
    /// letting go, or a refused answer's) fails the task once the driver is
    /// gone, if the task still waits for input.
    #[tokio::test]
    async fn a_deadline_passed_while_a_driver_is_on_a_waiting_task_fails_it_after() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        alices_task(&ledger, TaskState::InputRequired).await;
        let state = || ledger.get("t1").unwrap().unwrap().task.status.state;
        gateway.enter_running("t1");
        gateway
            .clone()
            .expire_at_deadline("t1".into(), chrono::Utc::now());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(state(), TaskState::InputRequired, "failed under a driver");
        gateway.unregister_running("t1");
        until_noted(|| state() == TaskState::Failed).await;
        ledger.close();
    }

    /// A stream that fell behind while sled failed cannot be replayed then;
    /// it goes on once sled is back, rather than ending as if the task had.
    #[tokio::test]
    async fn a_stream_goes_on_past_a_replay_the_ledger_could_not_serve() {
        use futures::StreamExt;
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        alices_working_task(&ledger).await;
        let request = SubscribeToTaskRequest {
            id: "t1".into(),
            ..SubscribeToTaskRequest::default()
        };
        let stream = gateway.subscribe(&alice(None), request).await.unwrap();
        let mut stream = stream.into_stream();
        let snapshot = stream.next().await.unwrap().unwrap();

        let fault = ledger.fail_sled(std::io::ErrorKind::Other);
        // More updates than the stream's channel holds: it falls behind.
        for _ in 0..200 {
            let again = |record: &mut TaskRecord| {
                Ok::<_, LedgerError>(vec![status_of(&record.task.id, TaskState::Working)])
            };
            ledger.update("t1", again).await.unwrap();
        }
        ledger.until_sled_fails().await;
        let recovering = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(fault);
        });
        let last = snapshot.seq + 200;
        let mut seen = snapshot.seq;
        let caught_up = tokio::time::timeout(Duration::from_secs(10), async {
            while seen < last {
                let event = stream.next().await.expect("the stream went on").unwrap();
                assert_eq!(event.seq, seen + 1, "in order, none lost");
                seen = event.seq;
            }
        });
        caught_up.await.expect("caught up once sled was back");
        recovering.await.unwrap();
        ledger.close();
    }

    /// A change the ledger refuses on what it read, such as a cancel
    /// meeting a completion, answers once that state is durable (the
    /// refusal quotes it), and while the log cannot append, with its failure.
    #[tokio::test]
    async fn an_update_refused_on_state_not_yet_durable_answers_once_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, _gateway) = open_gateway(dir.path());
        alices_working_task(&ledger).await;
        let refuse_ended = |record: &mut TaskRecord| {
            let state = record.task.status.state;
            if state.is_terminal() {
                return Err(GatewayError::UnsupportedOperation(format!("{state:?}")));
            }
            Ok(Vec::new())
        };

        let (hold, writer) = completed_behind_held_log(&ledger).await;
        let refused = ledger.update("t1", refuse_ended);
        tokio::pin!(refused);
        assert!(still_waiting(&mut refused).await, "answered before durable");
        drop(hold);
        let refusal = refused.await.unwrap_err();
        assert!(matches!(refusal, GatewayError::UnsupportedOperation(_)));
        writer.await.unwrap().unwrap();

        alices_task_named(&ledger, "t2", TaskState::Working).await;
        let fault = ledger.fail_log(std::io::ErrorKind::StorageFull);
        let writer = tokio::spawn({
            let ledger = ledger.clone();
            async move {
                let complete = |record: &mut TaskRecord| {
                    Ok::<_, LedgerError>(vec![status_of(&record.task.id, TaskState::Completed)])
                };
                ledger.update("t2", complete).await
            }
        });
        until_noted(|| {
            ledger
                .get("t2")
                .unwrap()
                .unwrap()
                .task
                .status
                .state
                .is_terminal()
        })
        .await;
        let answer = ledger.update("t2", refuse_ended);
        ledger_unavailable(answer, Duration::from_secs(2)).await;
        drop(fault);
        writer.await.unwrap().unwrap();
        ledger.close();
    }

    /// Refusals that quote a terminal state (CancelTask's -32002, a
    /// message's -32004) come only once that state is durable.
    #[tokio::test]
    async fn refusals_quote_a_terminal_state_only_once_it_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        alices_working_task(&ledger).await;
        let ctx = alice(None);

        let (hold, writer) = completed_behind_held_log(&ledger).await;
        let cancel = gateway.cancel_task(
            &ctx,
            CancelTaskRequest {
                id: "t1".into(),
                ..CancelTaskRequest::default()
            },
        );
        tokio::pin!(cancel);
        assert!(still_waiting(&mut cancel).await, "CancelTask waited");
        let mut more = hi("m-more");
        more.task_id = "t1".into();
        let send = gateway.send_message(
            &ctx,
            SendMessageRequest {
                message: Some(more),
                ..SendMessageRequest::default()
            },
        );
        tokio::pin!(send);
        assert!(still_waiting(&mut send).await, "SendMessage waited");

        drop(hold);
        assert_eq!(cancel.await.unwrap_err().code(), -32002);
        assert_eq!(send.await.unwrap_err().code(), -32004);
        writer.await.unwrap().unwrap();
        ledger.close();
    }

    /// While the log cannot make a terminal state durable, a refusal that
    /// would quote it is LEDGER_UNAVAILABLE, not left waiting.
    #[tokio::test]
    async fn a_cancel_of_a_task_ending_while_the_log_fails_is_answered() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        alices_working_task(&ledger).await;
        let fault = ledger.fail_log(std::io::ErrorKind::StorageFull);
        let writer = complete_in_background(&ledger);
        ledger.until_log_fails().await;

        let ctx = alice(None);
        let cancel = gateway.cancel_task(
            &ctx,
            CancelTaskRequest {
                id: "t1".into(),
                ..CancelTaskRequest::default()
            },
        );
        ledger_unavailable(cancel, Duration::from_secs(2)).await;
        drop(fault);
        writer.await.unwrap().unwrap();
        ledger.close();
    }

    /// A caller that hangs up while its idempotent send waits on the log
    /// drops the request's future; the send still ends, so a retry with the
    /// same key is answered, not held on a claim that no task ever fills.
    #[tokio::test]
    async fn a_send_whose_caller_hung_up_still_ends_for_its_idempotency_key() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let ctx = alice(Some("key-1"));
        let request = || SendMessageRequest {
            message: Some(hi("m1")),
            ..SendMessageRequest::default()
        };

        let hold = ledger.hold_log();
        let send = gateway.send_message(&ctx, request());
        assert!(still_waiting(send).await, "the claim waited on the log");
        drop(hold);

        // Under the 5 s an unfilled claim is waited for before a retry fails.
        let retry = gateway.send_message(&ctx, request());
        let answered = tokio::time::timeout(Duration::from_secs(3), retry).await;
        answered.expect("answered in time").expect("answered");
        ledger.close();
    }

    /// A repeated send replays the first one's direct reply from the ledger,
    /// where it may not be durable yet: the replay waits until it is.
    #[tokio::test]
    async fn a_replayed_direct_reply_is_shown_only_once_durable() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, gateway) = open_gateway(dir.path());
        let ctx = alice(Some("key-2"));
        let message = hi("m2");
        let first = store::IdempotencyRecord {
            fingerprint: send::fingerprint("echo", &message),
            task_id: "t-first".into(),
            message: Some(Message::agent(vec![Part::text("hello")])),
            claimed_by: ledger.instance(),
            history_from: None,
            claim_number: 0,
        };

        let hold = ledger.hold_log();
        let writer = tokio::spawn({
            let ledger = ledger.clone();
            async move { ledger.complete_idempotency("alice", "key-2", &first).await }
        });
        until_noted(|| {
            ledger
                .claim_idempotency_peek("alice", "key-2")
                .unwrap()
                .is_some()
        })
        .await;
        let request = SendMessageRequest {
            message: Some(message),
            ..SendMessageRequest::default()
        };
        let replay = gateway.send_message(&ctx, request);
        tokio::pin!(replay);
        assert!(still_waiting(&mut replay).await, "the replay waited");

        drop(hold);
        match replay.await.unwrap() {
            SendReply::Message(reply) => assert_eq!(reply.text(), "hello"),
            SendReply::Task(_) => panic!("a task instead of the first send's reply"),
        }
        writer.await.unwrap().unwrap();
        ledger.close();
    }
}
