//! SendMessage and SendStreamingMessage: validation, continuation rules,
//! idempotency, direct handoffs and routing, up to the point where a
//! [`Driver`] takes the task to its agent.

use super::driver::{Driver, Start, Turn, continuation_refused, send_first, status_update};
use super::relay::{agent_view, agent_views, handoff_return_schema, policy_refusal};
use super::stream::TaskEventStream;
use super::validate::{self, check_history_length, check_message, finish};
use super::{CallContext, Gateway, TaskReply};
use crate::agents::{AgentRequest, FollowUp};
use crate::error::GatewayError;
use crate::handoff::context::{direct_history, message_bytes};
use crate::handoff::control::{Control, Incoming, Limits};
use crate::handoff::payload::{
    HandoffPayload, HandoffTarget, PayloadValidator, find_payload, violations_detail,
};
use crate::handoff::reasons::{self, status_part};
use crate::handoff::routing::{RouteInput, Routed, declares_skill};
use crate::lifecycle::TransitionError;
use crate::protocol::*;
use crate::registry::AgentEntry;
use crate::store::hub::EventHub;
use crate::store::{HopKind, HopRecord, IdempotencyRecord, LedgerError, TaskRecord};
use futures::FutureExt as _;
use futures::future::Either;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::{broadcast, oneshot, watch};

/// What a send produced first.
pub(super) enum First {
    /// The agent answered with a message; no task exists.
    Message(Message),
    /// The task exists in the ledger: created (`None`, its log starts with
    /// its snapshot) or continued (the record right after the continuation).
    Task(Option<Arc<TaskRecord>>),
    /// The agent failed before any task existed.
    Error(GatewayError),
}

/// What SendStreamingMessage streams.
pub enum SendOutcome {
    /// A single direct message.
    Message(Message),
    /// The task's events.
    Task(TaskEventStream),
}

/// How a send began: its agent is running, or it repeats an earlier send.
/// `W`: what watches the task's events (a stream's receiver, or nothing).
enum Begun<W> {
    /// A new execution.
    Started(Started<W>),
    /// An idempotent repeat: what the first send with the key produced.
    Replay(IdempotencyRecord),
    /// Refused before any agent saw it: the task is already terminal.
    Settled(Arc<TaskRecord>),
    /// Taken by the agent through the execution that follows the task
    /// (the record right after the message went into it).
    FollowedUp(Arc<TaskRecord>, W),
}

/// `SendMessage`'s answer; serializes as a `SendMessageResponse`.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub enum SendReply {
    /// The task the message created or continued.
    Task(TaskReply),
    /// A direct reply; no task exists.
    Message(Message),
}

impl SendReply {
    fn task(record: Arc<TaskRecord>, config: &SendMessageConfiguration) -> Self {
        Self::Task(TaskReply::new(record, config.history_length))
    }
}

/// A send whose agent is running.
struct Started<W> {
    task_id: String,
    first: oneshot::Receiver<First>,
    watcher: W,
    driver_done: watch::Receiver<bool>,
}

/// What became of a message handed to the execution following its task.
enum Handed {
    /// None follows the task: a new execution takes the message.
    NoFollower,
    /// The one that did ended before the agent took the message.
    FollowerGone,
    /// The agent took it; the task right after it went into its history.
    Taken(Arc<TaskRecord>),
    /// The agent or the task's limits refused it.
    Refused(GatewayError),
}

/// A message to a task in terminal `state`.
fn terminal_refusal(task_id: &str, state: TaskState) -> GatewayError {
    GatewayError::UnsupportedOperation(format!(
        "task {task_id} is in terminal state {} and accepts no more messages",
        state.proto_name()
    ))
}

/// A start run in a task of its own that panicked or was cancelled.
fn start_failed(err: tokio::task::JoinError) -> GatewayError {
    GatewayError::Internal(format!("starting the send failed: {err}"))
}

/// What an idempotent send is compared by: the agent its caller addressed
/// and its message.
pub(super) fn fingerprint(agent_id: &str, message: &Message) -> String {
    let mut hasher = Sha256::new();
    hasher.update(agent_id.as_bytes());
    hasher.update([0]);
    hasher.update(serde_json::to_vec(message).unwrap_or_default());
    format!("{:x}", hasher.finalize())
}

impl Gateway {
    /// `SendMessage`.
    pub async fn send_message(
        self: &Arc<Self>,
        ctx: &CallContext,
        req: SendMessageRequest,
    ) -> Result<SendReply, GatewayError> {
        let config = req.configuration.clone().unwrap_or_default();
        // A blocking send watches its task only if the ledger does not show it
        // settled once the agent's first answer is in (`wait_settled`).
        let mut started = match self.begin(ctx, req, false, |_, _| ()).await? {
            Begun::Started(started) => started,
            Begun::Replay(earlier) => return self.replay_send(ctx, earlier, &config).await,
            Begun::Settled(record) => return Ok(SendReply::task(record, &config)),
            Begun::FollowedUp(record, ()) => {
                if !config.return_immediately {
                    self.wait_settled(&record.task.id, None).await;
                }
                let reply = self
                    .owned_reply(ctx, &record.task.id, config.history_length)
                    .await?;
                return Ok(SendReply::Task(reply));
            }
        };
        match (&mut started.first).await {
            Ok(First::Message(message)) => return Ok(SendReply::Message(message)),
            Ok(First::Error(err)) => return Err(err),
            Ok(First::Task(_)) => {}
            Err(_) => return Err(GatewayError::Internal("agent driver ended early".into())),
        }
        if !config.return_immediately {
            self.wait_settled(&started.task_id, Some(&mut started.driver_done))
                .await;
        }
        let reply = self
            .owned_reply(ctx, &started.task_id, config.history_length)
            .await?;
        Ok(SendReply::Task(reply))
    }

    /// `SendStreamingMessage`.
    pub async fn send_streaming_message(
        self: &Arc<Self>,
        ctx: &CallContext,
        req: SendMessageRequest,
    ) -> Result<SendOutcome, GatewayError> {
        let mut started = match self.begin(ctx, req, true, EventHub::watch).await? {
            Begun::Started(started) => started,
            Begun::FollowedUp(record, watcher) => {
                return Ok(SendOutcome::Task(TaskEventStream::from_snapshot(
                    self.clone(),
                    &record,
                    watcher,
                    true,
                )));
            }
            Begun::Settled(record) => {
                let watcher = self.ledger.hub().watch(&record.task.id);
                return Ok(SendOutcome::Task(TaskEventStream::from_snapshot(
                    self.clone(),
                    &record,
                    watcher,
                    true,
                )));
            }
            Begun::Replay(earlier) => {
                if let Some(message) = earlier.message {
                    // Read from the ledger, maybe before it was durable.
                    self.ledger.sync().await;
                    return Ok(SendOutcome::Message(message));
                }
                // Watch before reading, so no event falls between the two.
                let watcher = self.ledger.hub().watch(&earlier.task_id);
                let record = self.owned_durable_task(ctx, &earlier.task_id).await?;
                return Ok(SendOutcome::Task(TaskEventStream::from_snapshot(
                    self.clone(),
                    &record,
                    watcher,
                    true,
                )));
            }
        };
        match (&mut started.first).await {
            Ok(First::Message(message)) => Ok(SendOutcome::Message(message)),
            Ok(First::Error(err)) => Err(err),
            Ok(First::Task(Some(record))) => Ok(SendOutcome::Task(TaskEventStream::from_snapshot(
                self.clone(),
                &record,
                started.watcher,
                true,
            ))),
            Ok(First::Task(None)) => Ok(SendOutcome::Task(TaskEventStream::from_start(
                self.clone(),
                started.task_id,
                started.watcher,
            ))),
            Err(_) => Err(GatewayError::Internal("agent driver ended early".into())),
        }
    }

    /// Answers a repeated idempotent send with what the first one created,
    /// waiting like the first send when it blocks.
    async fn replay_send(
        &self,
        ctx: &CallContext,
        earlier: IdempotencyRecord,
        config: &SendMessageConfiguration,
    ) -> Result<SendReply, GatewayError> {
        if let Some(message) = earlier.message {
            // Read from the ledger, maybe before it was durable; a replay is
            // rare enough to wait for everything written so far.
            self.ledger.sync().await;
            return Ok(SendReply::Message(message));
        }
        if !config.return_immediately {
            self.wait_settled(&earlier.task_id, None).await;
        }
        let reply = self
            .owned_reply(ctx, &earlier.task_id, config.history_length)
            .await?;
        Ok(SendReply::Task(reply))
    }

    /// The control of the task the incoming control names as its parent,
    /// when the caller may extend its line of work.
    fn parent_lineage(&self, ctx: &CallContext, incoming: &Incoming) -> Option<Control> {
        let parent_id = incoming.metadata.as_ref()?.parent_task_id.as_deref()?;
        let parent = self.lineage_task(ctx, parent_id)?;
        Control::read_from(parent.task.metadata.as_ref())
    }

    /// Resolves a direct handoff (DESIGN.md §3.3): a message with a payload
    /// part goes to the payload's `to`, or to an agent with its `toSkill`.
    /// An invalid payload or an unknown target becomes a refusal (a REJECTED
    /// task); a `to` that contradicts the addressed agent is -32602. A
    /// message without a payload goes where the caller or the rules say.
    fn direct_handoff(
        &self,
        ctx: &CallContext,
        message: &Message,
        metadata: Option<&crate::protocol::wire::Struct>,
    ) -> Result<(String, Handoff), GatewayError> {
        let addressed = ctx.agent_id.clone();
        let Some(data) = find_payload(message) else {
            // Routed (§3.3): the rules choose when the caller named no agent,
            // a handoff to the agent a rule chose (by a skill, a reroute
            // may choose another); the default agent takes a plain call.
            let routed = (!ctx.pinned)
                .then(|| self.route(ctx, message, metadata))
                .flatten();
            return Ok(match routed {
                Some(routed) => {
                    let handoff = Handoff {
                        kind: HopKind::Routed,
                        skill: routed.skill,
                        ..Handoff::default()
                    };
                    (routed.agent, handoff)
                }
                None => (addressed, Handoff::default()),
            });
        };
        let payload = match PayloadValidator::shared().validate(data) {
            Ok(payload) => payload,
            Err(violations) => {
                let refusal = (reasons::SCHEMA_INVALID, violations_detail(&violations));
                return Ok((addressed, Handoff::refused(None, refusal)));
            }
        };
        let handoff_id = Some(payload.handoff_id.clone());
        let accepted = |skill: Option<String>| Handoff {
            handoff_id: handoff_id.clone(),
            kind: HopKind::Direct,
            skill,
            payload: Some(Box::new(payload.clone())),
            refusal: None,
            relayed: false,
        };
        // A payload another gateway already routed arrives with its handoffId
        // in the control: it is a delivery to the addressed agent, whose id
        // at this gateway need not be the one the payload names.
        let routed_upstream = ctx.pinned
            && Control::read_from(message.metadata.as_ref())
                .and_then(|c| c.handoff_id)
                .is_some_and(|id| id == payload.handoff_id);
        if routed_upstream {
            let relayed = Handoff {
                relayed: true,
                ..accepted(None)
            };
            return Ok((addressed, relayed));
        }
        match &payload.target {
            HandoffTarget::Agent(to) => {
                if ctx.pinned && *to != addressed {
                    return Err(GatewayError::invalid_field(
                        "message.parts",
                        format!(
                            "the handoff payload names {to:?}, but the call is addressed to {addressed:?}"
                        ),
                    ));
                }
                if self.agent(to).is_some() {
                    Ok((to.clone(), accepted(None)))
                } else {
                    let refusal = (reasons::TARGET_NOT_FOUND, serde_json::json!({"to": to}));
                    Ok((to.clone(), Handoff::refused(handoff_id, refusal)))
                }
            }
            HandoffTarget::Skill(skill) => {
                // Not back to its sender, as a transfer is not.
                let candidates = if ctx.pinned {
                    // The call names its agent: only that one, healthy or
                    // not (another's health must not refuse it).
                    self.agent(&addressed)
                        .filter(|entry| entry.id != payload.from)
                        .filter(|entry| declares_skill(&agent_view(entry), skill))
                        .into_iter()
                        .collect()
                } else {
                    self.agents_for_skill(skill, std::slice::from_ref(&payload.from))
                };
                // Balanced across the healthy agents declaring the skill
                // that the control the caller sent (in the message and its
                // headers) lets its sender reach.
                let mut incoming = ctx.incoming.clone();
                incoming.metadata = Control::read_from(message.metadata.as_ref());
                let lineage = self.parent_lineage(ctx, &incoming);
                let limits = Limits {
                    max_hops: self.settings.max_hops,
                    task_timeout: self.settings.task_timeout,
                };
                let control =
                    Control::merge(&incoming, lineage.as_ref(), limits, chrono::Utc::now());
                match self.balanced_allowed(&candidates, &control, Some(&payload.from)) {
                    Some(target) => Ok((target.id.clone(), accepted(Some(skill.clone())))),
                    None => {
                        let refusal = (
                            reasons::TARGET_NOT_FOUND,
                            serde_json::json!({"toSkill": skill}),
                        );
                        Ok((addressed, Handoff::refused(handoff_id, refusal)))
                    }
                }
            }
        }
    }

    /// The agent the routing rules choose for a message, and the skill it
    /// was chosen by, if any rule matches.
    fn route(
        &self,
        ctx: &CallContext,
        message: &Message,
        metadata: Option<&crate::protocol::wire::Struct>,
    ) -> Option<Routed> {
        let entries = self.directory().list();
        let views = agent_views(&entries);
        let input = RouteInput {
            tenant: ctx.tenant_label.as_deref(),
            message,
            metadata,
        };
        self.settings
            .routing
            .decide(&input, &views, self.next_balance())
    }

    /// The sender a call names (a payload's `from`, or the end of its chain)
    /// is the caller's word. Where it decides something, a target keeping
    /// an allow list, an agent registered here, or deregistered since, is
    /// taken as the sender only from the agency that registered it:
    /// NOT_ALLOWED for any other authenticated caller. It stands when it is
    /// `vouched`, the agent that held the parent task by the ledger's own
    /// record. A name no agency holds here (an agent behind a peer gateway,
    /// the operator's start-up and built-in agents, agents registered
    /// before any key existed) stays the caller's word; without API keys no
    /// caller is known, and none is checked. A retired id whose record the
    /// ledger cannot read is an error, not a pass.
    pub(super) fn claimed_source_refusal(
        &self,
        principal: &str,
        source: Option<&str>,
        target: Option<&AgentEntry>,
        vouched: Option<&str>,
    ) -> Result<Option<super::relay::Refusal>, GatewayError> {
        let Some(source) = source else {
            return Ok(None);
        };
        let guarded = target.is_some_and(|entry| entry.policy.allow_from.is_some());
        if !guarded || principal == crate::auth::ANONYMOUS || vouched == Some(source) {
            return Ok(None);
        }
        let unverifiable = [crate::launch::LOCAL_OWNER, crate::auth::ANONYMOUS];
        let foreign = |owner: &str| owner != principal && !unverifiable.contains(&owner);
        let impersonated = match self.agent(source) {
            Some(entry) => foreign(&entry.owner),
            // Unread, the record might have named another agency: the send
            // fails rather than pass unchecked.
            None => self
                .ledger
                .retired_agent_owner(source)?
                .is_some_and(|owner| foreign(&owner)),
        };
        Ok(impersonated.then(|| {
            let detail = serde_json::json!({
                "source": source,
                "target": target.map(|entry| entry.id.as_str()),
                "why": "the source is an agent registered by another agency",
            });
            (reasons::NOT_ALLOWED, detail)
        }))
    }

    /// Records a task refused by policy: REJECTED at once, with the reason
    /// code in a status part, and never delivered.
    async fn reject<W>(
        &self,
        ctx: &CallContext,
        agent_id: &str,
        message: Message,
        control: &Control,
        reason: &str,
        detail: serde_json::Value,
    ) -> Result<Begun<W>, GatewayError> {
        let mut status = Message::agent(vec![status_part(reason, detail)]);
        status.task_id = message.task_id.clone();
        status.context_id = message.context_id.clone();
        let mut metadata = None;
        control.write_into(&mut metadata);
        let snapshot = Task {
            id: message.task_id.clone(),
            context_id: message.context_id.clone(),
            status: TaskStatus::now(TaskState::Rejected, Some(status.clone())),
            history: vec![message, status],
            metadata,
            ..Task::default()
        };
        let record = TaskRecord {
            task: Task {
                id: snapshot.id.clone(),
                context_id: snapshot.context_id.clone(),
                ..Task::default()
            },
            owner: ctx.principal.clone(),
            agent: agent_id.to_string(),
            parent_task_id: self.linked_parent(&ctx.principal, control.parent_task_id.as_deref()),
            created_at: chrono::Utc::now(),
            ..TaskRecord::default()
        };
        tracing::info!(task_id = %snapshot.id, agent = agent_id, reason, "handoff refused");
        self.metrics.rejected(reason);
        let record = self
            .ledger
            .create(record, vec![StreamResponse::Task(snapshot)])
            .await?;
        Ok(Begun::Settled(record))
    }

    /// Checks a repeat against the first send with its key; `None` if that
    /// send failed before any task existed and let go of the key, which a
    /// repeat may then claim.
    async fn replay<W>(
        &self,
        ctx: &CallContext,
        key: &str,
        claim: &IdempotencyRecord,
        earlier: IdempotencyRecord,
        resolved_fingerprint: impl FnOnce() -> String,
        answer: Option<&str>,
    ) -> Result<Option<Begun<W>>, GatewayError> {
        // Builds before this one took the fingerprint of the agent the send
        // was resolved to; a claim they stored still matches by that.
        if earlier.fingerprint != claim.fingerprint && earlier.fingerprint != resolved_fingerprint()
        {
            return Err(GatewayError::invalid_field(
                "message",
                format!("idempotency key {key:?} was already used with a different message"),
            ));
        }
        let earlier = self.await_idempotent_result(ctx, earlier, answer).await?;
        Ok(earlier.map(Begun::Replay))
    }

    /// Waits until the task is terminal or interrupted, its driver (if
    /// given) stops, or the task timeout passes.
    async fn wait_settled(
        &self,
        task_id: &str,
        mut driver_done: Option<&mut watch::Receiver<bool>>,
    ) {
        // Most sends settle in the write that creates their task: those
        // need no channel of events.
        if self.settled(task_id) {
            return;
        }
        let mut watcher = self.ledger.hub().watch_outcome(task_id);
        let deadline = tokio::time::sleep(self.settings.task_timeout);
        tokio::pin!(deadline);
        // The ledger is read when an event alone cannot tell: right after
        // watching (an event may have come before), after a missed event,
        // and for an interruption, which may be a late event of an earlier
        // turn. A terminal state is final whatever its turn.
        let mut look = true;
        loop {
            if look {
                if self.settled(task_id) {
                    return;
                }
                look = false;
            }
            if driver_done.as_ref().is_some_and(|done| *done.borrow()) {
                return;
            }
            let driver_changed = async {
                match driver_done.as_mut() {
                    Some(done) => {
                        let _ = done.changed().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                event = watcher.recv() => match event {
                    Ok(event) => match event.event.state() {
                        Some(state) if state.is_terminal() => return,
                        Some(state) if state.is_interrupted() => look = true,
                        _ => {}
                    },
                    Err(broadcast::error::RecvError::Lagged(_)) => look = true,
                    Err(broadcast::error::RecvError::Closed) => {
                        watcher = self.ledger.hub().watch_outcome(task_id);
                        look = true;
                    }
                },
                _ = driver_changed => look = true,
                _ = &mut deadline => return,
                _ = self.shutdown.cancelled() => return,
            }
        }
    }

    /// Whether a task is terminal or interrupted, as the ledger has it now.
    fn settled(&self, task_id: &str) -> bool {
        self.ledger
            .get_shared(task_id)
            .is_ok_and(|record| record.is_some_and(|r| r.task.status.state.is_settled()))
    }

    /// [`Gateway::start`], run to its end even if the caller hangs up (hyper
    /// then drops the request's future). A start awaits ledger writes only
    /// for an idempotency claim, a push config or a handoff's acceptance;
    /// dropped part way, it would leave the key claimed for a task that never
    /// comes, or an accepted handoff with no driver. Those run in a task of
    /// their own; a plain send, which awaits nothing there, runs in place.
    ///
    /// A plain function returning the one future the send awaits: built in
    /// an `async fn`, the spawned future kept a slot in every send's state,
    /// which each send boxes and copies whole (~8 k instructions, callgrind).
    fn begin<'a, W, F>(
        self: &'a Arc<Self>,
        ctx: &'a CallContext,
        req: SendMessageRequest,
        streaming: bool,
        watch: F,
    ) -> impl Future<Output = Result<Begun<W>, GatewayError>> + 'a
    where
        W: Send + 'static,
        F: FnOnce(&EventHub, &str) -> W + Send + 'static,
    {
        let must_finish = ctx.idempotency_key.is_some()
            || req
                .configuration
                .as_ref()
                .is_some_and(|c| c.task_push_notification_config.is_some())
            || req.message.as_ref().and_then(find_payload).is_some();
        if !must_finish {
            return Either::Right(self.start(ctx, req, streaming, watch));
        }
        let gateway = self.clone();
        let ctx = ctx.clone();
        let started = tokio::spawn(async move { gateway.start(&ctx, req, streaming, watch).await });
        Either::Left(started.map(|joined| joined.map_err(start_failed)?))
    }

    /// Validates a send, resolves a continuation, claims the idempotency key
    /// and starts the agent. `watch` makes the send's watcher of the task's
    /// events, before any can be published.
    async fn start<W>(
        self: &Arc<Self>,
        ctx: &CallContext,
        req: SendMessageRequest,
        streaming: bool,
        watch: impl FnOnce(&EventHub, &str) -> W,
    ) -> Result<Begun<W>, GatewayError> {
        let mut violations = Vec::new();
        let Some(mut message) = req.message else {
            return Err(GatewayError::invalid_field("message", "is required"));
        };
        check_message(&message, "message", &mut violations);
        let config = req.configuration.unwrap_or_default();
        check_history_length(
            config.history_length,
            "configuration.historyLength",
            &mut violations,
        );
        if let Some(push) = &config.task_push_notification_config {
            self.check_push_enabled()?;
            self.push.check_config(
                push,
                "configuration.taskPushNotificationConfig.",
                &mut violations,
            );
        }
        finish(violations)?;

        // A continuation stays with the agent that holds the task.
        let mut continued = if message.task_id.is_empty() {
            None
        } else {
            Some(self.owned_task(ctx, &message.task_id)?)
        };
        let (agent_id, handoff) = match &continued {
            Some(record) => (record.agent.clone(), Handoff::default()),
            None => self.direct_handoff(ctx, &message, req.metadata.as_ref())?,
        };
        // Only an idempotent send is ever compared with another, by what its
        // caller sent and where: the agent a skill or a rule picked, or that
        // holds the task now, may differ at a repeat.
        let sent_fingerprint = if ctx.idempotency_key.is_some() {
            // A tenant label addresses the gateway as a label of its own.
            let addressed = ctx.tenant_label.as_deref().unwrap_or(&ctx.agent_id);
            fingerprint(addressed, &message)
        } else {
            String::new()
        };
        // Older builds' claims are matched by the agent the send resolved to.
        let resolved_fingerprint = || fingerprint(&agent_id, &message);

        // A repeated idempotent send answers like the first, whatever the task
        // has become since; so this comes before the state checks.
        let task_id = continued
            .as_ref()
            .map_or_else(|| uuid::Uuid::now_v7().to_string(), |r| r.task.id.clone());
        // Held from before the claim is written, so no repeat ever sees the
        // claim without it.
        let held_claim = ctx.idempotency_key.as_ref().map(|_| self.hold_claim());
        let claim = IdempotencyRecord {
            fingerprint: sent_fingerprint.clone(),
            task_id: task_id.clone(),
            message: None,
            claimed_by: self.ledger.instance(),
            history_from: continued.as_ref().map(|record| record.task.history.len()),
            claim_number: held_claim.as_ref().map_or(0, |held| held.number),
        };
        // A continuation's claim is filled once its message is in the task.
        let answer = continued.is_some().then_some(message.message_id.as_str());
        if let Some(key) = &ctx.idempotency_key
            && let Some(earlier) = self.ledger.claim_idempotency_peek(&ctx.principal, key)?
            && let Some(replayed) = self
                .replay(ctx, key, &claim, earlier, resolved_fingerprint, answer)
                .await?
        {
            return Ok(replayed);
        }
        // While the log cannot make writes durable, a send would run its
        // agent for a task the ledger cannot keep; while sled fails, the
        // log and the applier's memory would grow with it until a restart.
        // So it is refused before it writes anything (a repeat, above, needs
        // no write); writes already noted wait, or are kept by the log.
        if let Some(failure) = self.ledger.failure() {
            return Err(GatewayError::LedgerUnavailable(format!(
                "{failure}; the send was not started"
            )));
        }

        if let Some(record) = &continued {
            let state = record.task.status.state;
            if state.is_terminal() {
                // A terminal state read may not be durable yet.
                self.ledger.sync_unless_failing().await?;
                return Err(terminal_refusal(&record.task.id, state));
            }
            // A handoff's ladder is still looking for an agent to take it
            // (SUBMITTED, a transfer's target yet to answer, or a delivery
            // into a WORKING task waiting for its acknowledgement: a result's
            // return leg, an escalated handoff delivered again on its
            // caller's answer): there is no agent task yet that a message
            // could continue.
            let awaiting_ack = state == TaskState::Working
                && record
                    .hops
                    .last()
                    .is_some_and(|hop| hop.acked_at.is_none() && hop.kind != HopKind::Call);
            let unanswered = state == TaskState::Submitted
                || (record.transfer.is_some() && !state.is_interrupted());
            // (A return leg names its source's task as the upstream one.)
            if (unanswered && record.upstream.is_none()) || awaiting_ack {
                return Err(GatewayError::UnsupportedOperation(format!(
                    "task {} has not been taken up by an agent yet ({}); send more once it \
                     is working or asks for input",
                    record.task.id,
                    state.proto_name()
                )));
            }
            if !message.context_id.is_empty() && message.context_id != record.task.context_id {
                return Err(GatewayError::invalid_field(
                    "message.contextId",
                    format!(
                        "{:?} does not match the context {:?} of task {}",
                        message.context_id, record.task.context_id, record.task.id
                    ),
                ));
            }
        }
        // A refused handoff may name no agent at all; it never reaches one.
        let agent = self.agent(&agent_id);
        match &agent {
            Some(agent) => {
                // The agent a default or a rule picked had its card unchecked.
                validate::check_required_extensions(agent.agent.card(), &ctx.extensions)?;
                validate::check_input_modes(agent.agent.card(), &message)?;
            }
            None if handoff.refusal.is_none() => {
                return Err(GatewayError::invalid_field(
                    "tenant",
                    format!("unknown agent {agent_id:?}"),
                ));
            }
            None => {}
        }

        if let Some(key) = &ctx.idempotency_key {
            // Another send with this key may have claimed it since the peek
            // above; if it lets go of it, this one claims it in turn.
            while let Some(earlier) = self
                .ledger
                .claim_idempotency(&ctx.principal, key, &claim)
                .await?
            {
                if let Some(replayed) = self
                    .replay(ctx, key, &claim, earlier, resolved_fingerprint, answer)
                    .await?
                {
                    return Ok(replayed);
                }
            }
        }

        if continued.is_none() && message.context_id.is_empty() {
            // Minted from the task id: the task needs no by-context index entry.
            message.context_id = crate::store::keys::new_context_id(&task_id);
        }
        if let Some(record) = &continued {
            message.context_id = record.task.context_id.clone();
        }
        message.task_id = task_id.clone();

        // The config given for a new task, which a send failing before the
        // task exists takes back.
        let mut new_task_push = None;
        if let Some(mut push) = config.task_push_notification_config.clone() {
            push.task_id = task_id.clone();
            push.tenant.clear();
            if let Err(err) = self
                .store_sent_push_config(&mut push, continued.is_some())
                .await
            {
                self.release_claim(ctx).await;
                return Err(err);
            }
            if continued.is_none() {
                new_task_push = Some(push);
            }
        }

        // Handoff control (DESIGN.md §3.1): a new task is a new hop; a
        // continuation stays on the hop of its task.
        let mut parent_history = Vec::new();
        let control = match &continued {
            Some(record) => {
                let mut control =
                    Control::read_from(record.task.metadata.as_ref()).unwrap_or_default();
                let mut incoming = ctx.incoming.clone();
                incoming.metadata = Control::read_from(message.metadata.as_ref());
                control.shorten_to(&incoming);
                control
            }
            None => {
                let mut incoming = ctx.incoming.clone();
                incoming.metadata = Control::read_from(message.metadata.as_ref());
                let parent = incoming
                    .metadata
                    .as_ref()
                    .and_then(|c| c.parent_task_id.as_deref())
                    .and_then(|parent| self.lineage_task(ctx, parent));
                let lineage = parent
                    .as_ref()
                    .and_then(|parent| Control::read_from(parent.task.metadata.as_ref()));
                // The agent that held the parent task, by the ledger's record:
                // one its last hop reached and that took the work. A parent
                // refused before delivery names, at its chain's end, an agent
                // that never held it.
                let vouched: Option<String> = parent
                    .as_ref()
                    .and_then(|parent| parent.hops.last())
                    .filter(|hop| hop.acked_at.is_some())
                    .map(|hop| hop.agent.clone())
                    .filter(|holder| lineage.as_ref().and_then(|l| l.chain.last()) == Some(holder));
                // The conversation only to the parent's owner: the agency
                // of its holder is given what its agent is sent, no more.
                if let Some(parent) = parent.filter(|p| p.owner == ctx.principal) {
                    parent_history = Arc::unwrap_or_clone(parent).task.history;
                }
                // An agent's own limits only ever shorten the gateway's.
                let own = agent.as_ref().map(|a| &a.policy);
                let limits = Limits {
                    max_hops: own
                        .and_then(|p| p.max_hops)
                        .map_or(self.settings.max_hops, |m| m.min(self.settings.max_hops)),
                    task_timeout: own
                        .and_then(|p| p.task_timeout)
                        .map_or(self.settings.task_timeout, |t| {
                            t.min(self.settings.task_timeout)
                        }),
                };
                let mut merged =
                    Control::merge(&incoming, lineage.as_ref(), limits, chrono::Utc::now());
                if handoff.handoff_id.is_some() {
                    merged.handoff_id = handoff.handoff_id.clone();
                }
                // A gateway that relays to this agent under the same id
                // (its card points here) delivered it already: the same
                // delivery one hop on, not a cycle. A handoff names its
                // sender, so it is never taken for one, unless another
                // gateway routed it already.
                let relay = handoff.payload.is_none() || handoff.relayed;
                if relay && merged.chain.last() == Some(&agent_id) {
                    merged.chain.pop();
                }
                // Who hands off: the payload's sender, else the agent that
                // forwarded the call (the end of the chain it carries).
                let source = handoff
                    .payload
                    .as_ref()
                    .map(|p| p.from.clone())
                    .or_else(|| merged.chain.last().cloned());
                let (source, vouched) = (source.as_deref(), vouched.as_deref());
                let mut refusal = handoff
                    .refusal
                    .clone()
                    .or_else(|| policy_refusal(&merged, &agent_id, agent.as_deref(), source));
                if refusal.is_none() {
                    let principal = &ctx.principal;
                    match self.claimed_source_refusal(principal, source, agent.as_deref(), vouched)
                    {
                        Ok(claimed) => refusal = claimed,
                        Err(err) => {
                            self.abandon_start(ctx, new_task_push.as_ref()).await;
                            return Err(err);
                        }
                    }
                }
                if let Some((reason, detail)) = refusal {
                    let delivered = merged.delivered_to(&agent_id);
                    delivered.write_into(&mut message.metadata);
                    let rejected = self
                        .reject(ctx, &agent_id, message, &delivered, reason, detail)
                        .await;
                    if rejected.is_err() {
                        self.abandon_start(ctx, new_task_push.as_ref()).await;
                    }
                    return rejected;
                }
                merged.delivered_to(&agent_id)
            }
        };
        control.write_into(&mut message.metadata);

        let Some(agent) = agent else {
            return Err(GatewayError::invalid_field(
                "tenant",
                format!("unknown agent {agent_id:?}"),
            ));
        };

        // A direct handoff's context policy may add the parent's conversation.
        if let Some(payload) = &handoff.payload
            && let Some(history) = direct_history(payload.context, &parent_history)
        {
            message.parts.push(history);
        }

        let watcher = watch(self.ledger.hub(), &task_id);
        if let Some(record) = &continued {
            let modes = &config.accepted_output_modes;
            let handed = match self.hand_to_follower(record, &message, modes).await {
                Handed::NoFollower => Ok(None),
                Handed::Taken(record) => Ok(Some(record)),
                Handed::Refused(err) => Err(err),
                // It ended meanwhile (the task settled, or moved on): the
                // message goes on from the task as it is now.
                Handed::FollowerGone => match self.ledger.get_shared(&task_id) {
                    Ok(Some(now)) if now.task.status.state.is_terminal() => {
                        Err(terminal_refusal(&task_id, now.task.status.state))
                    }
                    // Read again, so that a message that now answers a
                    // question is taken as the answer (`Driver::resume`).
                    Ok(Some(now)) if now.same_holder(record) => {
                        continued = Some(now);
                        Ok(None)
                    }
                    Ok(Some(now)) => {
                        let moved = TransitionError::HandedOnMeanwhile(now.agent.clone());
                        Err(LedgerError::from(moved).into())
                    }
                    Ok(None) => Ok(None),
                    Err(err) => Err(err.into()),
                },
            };
            match handed {
                Ok(Some(record)) => return Ok(Begun::FollowedUp(record, watcher)),
                Ok(None) => {}
                Err(err) => {
                    self.release_claim(ctx).await;
                    return Err(err);
                }
            }
        }
        let (first_tx, first) = oneshot::channel();
        let (done_tx, driver_done) = watch::channel(false);
        let task_cancel = self.enter_running(&task_id);
        let request = AgentRequest {
            task_id: task_id.clone(),
            context_id: message.context_id.clone(),
            message,
            task: continued.as_ref().map(|r| r.task.clone()),
            upstream: continued.as_ref().and_then(|r| r.upstream.clone()),
            streaming,
            accepted_output_modes: config.accepted_output_modes,
            cancel: task_cancel.child_token(),
        };
        let deadline = control.deadline;
        let mut driver = Driver {
            gateway: self.clone(),
            owner: ctx.principal.clone(),
            idempotency_key: ctx.idempotency_key.clone(),
            fingerprint: sent_fingerprint,
            task_id: task_id.clone(),
            context_id: request.context_id.clone(),
            task_cancel,
            deadline,
            asked_ack_timeout: control.ack_timeout(),
            created: false,
            first_tx: Some(first_tx),
            tried: Vec::new(),
            last_state: None,
            adoptions: None,
            new_task_push: new_task_push.as_ref().map(|push| push.id.clone()),
            _held_claim: held_claim,
        };
        let start = match continued {
            Some(record) => Start::Continued(record),
            None if handoff.is_handoff() => {
                // A handoff is a task from acceptance: SUBMITTED until the
                // target acknowledges (DESIGN.md §3.4).
                if let Err(err) = self.accept_handoff(ctx, &agent, &handoff, &request).await {
                    self.unregister_running(&task_id);
                    self.abandon_start(ctx, new_task_push.as_ref()).await;
                    return Err(err);
                }
                send_first(&mut driver.first_tx, First::Task(None));
                Start::Accepted(1)
            }
            None => Start::New(handoff.kind),
        };
        let turn = Turn {
            agent,
            request,
            handoff: handoff.is_handoff(),
            skill: handoff.skill.clone(),
            source: handoff.payload.as_ref().map(|p| p.from.clone()),
        };
        // Boxed before spawning, so the task holds only the box (32 bytes, not
        // the 848 of the driver and its turn): the driver's future is large, and
        // spawning moves it whole.
        let run = Box::pin(driver.run(turn, start));
        tokio::spawn(async move {
            run.await;
            let _ = done_tx.send(true);
        });
        Ok(Begun::Started(Started {
            task_id,
            first,
            watcher,
            driver_done,
        }))
    }

    /// Hands `message`, for a task WORKING or AUTH_REQUIRED, to the
    /// execution that follows the task at its agent, if one does: the agent
    /// gets it without a second feed of the task (DESIGN.md §2). `None` when
    /// none does (any more): a new execution takes the message instead.
    async fn hand_to_follower(
        self: &Arc<Self>,
        record: &TaskRecord,
        message: &Message,
        accepted_output_modes: &[String],
    ) -> Handed {
        let state = record.task.status.state;
        if state != TaskState::Working && state != TaskState::AuthRequired {
            return Handed::NoFollower;
        }
        let Some(follower) = self.follower_of(&record.task.id, &record.agent) else {
            return Handed::NoFollower;
        };
        // The agent is sent nothing the task could not record.
        if let Err(err) = self.fits_one_more(record, message) {
            return Handed::Refused(continuation_refused(&record.task.id, err));
        }
        let (taken_tx, taken) = oneshot::channel();
        let (recorded, recorded_rx) = oneshot::channel::<()>();
        let asked = (state == TaskState::AuthRequired).then(|| record.task.status.clone());
        let follow_up = FollowUp {
            message: message.clone(),
            accepted_output_modes: accepted_output_modes.to_vec(),
            answers: asked.clone(),
            taken: taken_tx,
            recorded: recorded_rx,
        };
        // On a task of its own: once the agent took the message, the task
        // records it even if the caller hangs up.
        let gateway = self.clone();
        let (task_id, agent) = (record.task.id.clone(), record.agent.clone());
        let message = message.clone();
        let handed = tokio::spawn(async move {
            if follower.send(Box::new(follow_up)).await.is_err() {
                return Handed::FollowerGone;
            }
            match taken.await {
                Err(_) => Handed::FollowerGone,
                Ok(Ok(())) => {
                    let written = gateway.record_follow_up(&task_id, message, asked).await;
                    drop(recorded);
                    match written {
                        Ok(record) => Handed::Taken(record),
                        Err(err) => Handed::Refused(err),
                    }
                }
                Ok(Err(err)) => Handed::Refused(GatewayError::from(err).about_agent(&agent)),
            }
        });
        handed
            .await
            .unwrap_or_else(|err| Handed::Refused(start_failed(err)))
    }

    /// Whether `record` can take `message` and one event more within the
    /// task's limits; its size is estimated by encoding it.
    fn fits_one_more(&self, record: &TaskRecord, message: &Message) -> Result<(), LedgerError> {
        let limits = self.settings.task_limits();
        if record.last_seq >= limits.max_events {
            let (events, limit) = (record.last_seq, limits.max_events);
            return Err(LedgerError::TooManyEvents { events, limit });
        }
        let bytes = encoded_len(record) + encoded_len(message);
        if bytes > limits.max_bytes {
            let limit = limits.max_bytes;
            return Err(LedgerError::RecordTooLarge { bytes, limit });
        }
        Ok(())
    }

    /// Adds a follow-up the agent took to its task's history. One that
    /// answers the AUTH_REQUIRED status `asked` makes the task WORKING
    /// again, as an answer does, if the task still holds that status: the
    /// execution following the task decides alike (`FollowUp::answers`).
    async fn record_follow_up(
        &self,
        task_id: &str,
        message: Message,
        asked: Option<TaskStatus>,
    ) -> Result<Arc<TaskRecord>, GatewayError> {
        let limits = self.settings.task_limits();
        let message_id =
            |status: &TaskStatus| status.message.as_ref().map(|m| m.message_id.clone());
        self.ledger
            .update_within(task_id, limits, |current| {
                current.task.history.push(message);
                let now = &current.task.status;
                let answered = asked.as_ref().is_some_and(|asked| {
                    now.state == TaskState::AuthRequired && message_id(now) == message_id(asked)
                });
                let working = answered.then(|| {
                    let (task_id, context_id) = (&current.task.id, &current.task.context_id);
                    status_update(task_id, context_id, TaskState::Working, None)
                });
                Ok::<_, LedgerError>(working.into_iter().collect::<Vec<_>>())
            })
            .await
            .map_err(|err| continuation_refused(task_id, err))
    }

    /// Stores the push config a send gives for its task, under a fresh id
    /// when it names none; unless, continuing the task, it is one the task
    /// holds already but for the id. A client may attach one config to
    /// every message it sends (the Go SDK's client does): a copy would have
    /// the webhook sent every event twice and, by the eleventh message, be
    /// refused.
    async fn store_sent_push_config(
        &self,
        push: &mut TaskPushNotificationConfig,
        continuing: bool,
    ) -> Result<(), GatewayError> {
        if push.id.is_empty() {
            if continuing && self.holds_push_config(push).await? {
                return Ok(());
            }
            push.id = uuid::Uuid::new_v4().to_string();
        }
        self.store_push_config(push, "configuration.taskPushNotificationConfig")
            .await
    }

    /// Takes back what a send stored before it failed without making its
    /// task: the caller's idempotency key, and the push config it gave for
    /// the new task.
    async fn abandon_start(
        &self,
        ctx: &CallContext,
        new_task_push: Option<&TaskPushNotificationConfig>,
    ) {
        self.release_claim(ctx).await;
        if let Some(push) = new_task_push {
            self.take_back_push_config(&push.task_id, &push.id).await;
        }
    }

    /// Frees the caller's idempotency key after a send failed before any
    /// task existed, so a retry reaches the agent again.
    async fn release_claim(&self, ctx: &CallContext) {
        self.release_key(&ctx.principal, ctx.idempotency_key.as_deref())
            .await;
    }

    /// Frees `owner`'s idempotency key `key`, if given: no task or message
    /// will fill its claim.
    pub(super) async fn release_key(&self, owner: &str, key: Option<&str>) {
        if let Some(key) = key
            && let Err(err) = self.ledger.release_idempotency(owner, key).await
        {
            tracing::error!(%err, "could not release an idempotency key");
        }
    }

    /// Deletes the push config a send stored for a task it never made:
    /// left, it would wait for a task that never comes, and keep push
    /// delivery looking up every event.
    pub(super) async fn take_back_push_config(&self, task_id: &str, config_id: &str) {
        if let Err(err) = self.ledger.delete_push_config(task_id, config_id).await {
            tracing::error!(%err, "could not delete the push config of a send that failed");
        }
    }

    /// Records an accepted direct handoff as a SUBMITTED task, with its
    /// first hop and the schema its result must satisfy.
    async fn accept_handoff(
        &self,
        ctx: &CallContext,
        agent: &AgentEntry,
        handoff: &Handoff,
        request: &AgentRequest,
    ) -> Result<(), GatewayError> {
        let message = &request.message;
        let control = Control::read_from(message.metadata.as_ref());
        let named = handoff
            .payload
            .as_ref()
            .and_then(|p| p.return_schema.as_ref());
        let (return_schema, return_schema_by_skill) =
            handoff_return_schema(named, agent, handoff.skill.as_deref());
        let record = TaskRecord {
            task: Task {
                id: request.task_id.clone(),
                context_id: request.context_id.clone(),
                ..Task::default()
            },
            owner: ctx.principal.clone(),
            agent: agent.id.clone(),
            parent_task_id: self.linked_parent(
                &ctx.principal,
                control.as_ref().and_then(|c| c.parent_task_id.as_deref()),
            ),
            return_schema_by_skill,
            return_schema,
            created_at: chrono::Utc::now(),
            hops: vec![HopRecord {
                agent: agent.id.clone(),
                kind: handoff.kind,
                skill: (handoff.kind == HopKind::Routed)
                    .then(|| handoff.skill.clone())
                    .flatten(),
                started_at: chrono::Utc::now(),
                message_bytes: Some(message_bytes(message)),
                attempts: 1,
                ..HopRecord::default()
            }],
            ..TaskRecord::default()
        };
        let snapshot = Task {
            id: request.task_id.clone(),
            context_id: request.context_id.clone(),
            status: TaskStatus::now(TaskState::Submitted, None),
            history: vec![message.clone()],
            metadata: Control::entry_alone(message.metadata.as_ref()),
            ..Task::default()
        };
        let parent = record.parent_task_id.clone();
        self.ledger
            .create(record, vec![StreamResponse::Task(snapshot)])
            .await?;
        self.join_canceled_parent(parent.as_deref()).await;
        let source = match handoff.payload.as_ref().map(|p| p.from.as_str()) {
            None | Some("") => "",
            Some(from) if self.agent(from).is_some() => from,
            Some(_) => crate::metrics::UNREGISTERED_SOURCE,
        };
        let hops = control.map_or(1, |c| c.hops);
        self.metrics_handoff(
            (source, &agent.id),
            handoff.kind,
            hops,
            message_bytes(message),
        );
        Ok(())
    }

    /// Hands every task left SUBMITTED or WORKING by a previous run back to
    /// its agent, which resumes it or fails it with the reason; and sets
    /// the deadline timers of tasks waiting for input. Returns how many
    /// tasks were picked up.
    pub async fn recover_in_flight(self: &Arc<Self>) -> Result<usize, GatewayError> {
        let ids = self.ledger.active_task_ids()?;
        let mut recovered = 0;
        for task_id in ids {
            let Some(record) = self.record_at_start_up(&task_id)? else {
                continue;
            };
            let Some(agent) = self.agent(&record.agent) else {
                tracing::warn!(task_id, agent = %record.agent, "in-flight task of an agent no longer registered");
                let detail = serde_json::json!({"to": record.agent});
                let parts = vec![status_part(reasons::TARGET_NOT_FOUND, detail)];
                super::driver::settle_task(self, &task_id, TaskState::Failed, parts).await;
                self.release_paused_sources(&task_id).await;
                continue;
            };
            self.follow_at_start_up(agent, record);
            recovered += 1;
        }
        for task_id in self.ledger.waiting_task_ids()? {
            let Some(record) = self.record_at_start_up(&task_id)? else {
                continue;
            };
            // At AUTH_REQUIRED an agent may go on unasked (A2A §7.6.1): it is
            // followed, as before the restart.
            let agent = self.agent(&record.agent);
            if record.task.status.state == TaskState::AuthRequired
                && record.upstream.is_some()
                && let Some(agent) = agent.filter(|agent| agent.agent.takes_follow_ups())
            {
                self.follow_at_start_up(agent, record);
                recovered += 1;
                continue;
            }
            // Nobody drives a task waiting for input; its deadline still holds.
            let deadline = Control::read_from(record.task.metadata.as_ref())
                .and_then(|control| control.deadline);
            if let Some(deadline) = deadline {
                self.clone().expire_at_deadline(task_id, deadline);
            }
        }
        Ok(recovered)
    }

    /// Has a driver pick `record` up from its agent at start-up.
    fn follow_at_start_up(self: &Arc<Self>, agent: Arc<AgentEntry>, record: TaskRecord) {
        let task_cancel = self.enter_running(&record.task.id);
        let control = Control::read_from(record.task.metadata.as_ref());
        let driver = Driver {
            gateway: self.clone(),
            owner: record.owner.clone(),
            idempotency_key: None,
            fingerprint: String::new(),
            task_id: record.task.id.clone(),
            context_id: record.task.context_id.clone(),
            task_cancel,
            deadline: control.as_ref().and_then(|c| c.deadline),
            asked_ack_timeout: control.as_ref().and_then(Control::ack_timeout),
            created: true,
            first_tx: None,
            tried: Vec::new(),
            last_state: None,
            adoptions: None,
            new_task_push: None,
            _held_claim: None,
        };
        tokio::spawn(driver.recover(agent, record));
    }

    /// A task's record as start-up picks it up. One that does not decode is
    /// left as it is, and said loudly (`None`): one damaged record must not
    /// keep every other task, and the gateway, down.
    fn record_at_start_up(&self, task_id: &str) -> Result<Option<TaskRecord>, GatewayError> {
        match self.ledger.get(task_id) {
            Err(err) if err.is_corrupt() => {
                tracing::error!(task_id, %err, "a task's record does not decode; it is not picked up at start-up");
                Ok(None)
            }
            read => Ok(read?),
        }
    }

    /// A repeated send may arrive while the first is still deciding between
    /// a task and a message, or still on its way into the task it continues
    /// (`answer` is then its message's id); waits for the outcome as long as
    /// the first send may take (the task timeout). `None`, and this send
    /// claims the key in turn, if the first let go of it (or another claim
    /// took it since), or ended without filling it: before a restart, or in
    /// this run (a failure that did not let go of it, a panic).
    async fn await_idempotent_result(
        &self,
        ctx: &CallContext,
        mut earlier: IdempotencyRecord,
        answer: Option<&str>,
    ) -> Result<Option<IdempotencyRecord>, GatewayError> {
        let give_up = tokio::time::Instant::now() + self.settings.task_timeout;
        let mut pause = Duration::from_millis(20);
        loop {
            if self.claim_filled(&earlier, answer)? {
                return Ok(Some(earlier));
            }
            // Filled before the send holding it let go, or never: so it is
            // checked again once that send is seen gone.
            if let Some(key) = &ctx.idempotency_key
                && !self.claim_is_held(&earlier)
                && !self.claim_filled(&earlier, answer)?
            {
                tracing::info!(task_id = %earlier.task_id, "an idempotency key claimed by a send that ended without getting its message into a task is taken over");
                self.ledger
                    .release_idempotency_if(&ctx.principal, key, &earlier)
                    .await?;
                return Ok(None);
            }
            if tokio::time::Instant::now() >= give_up {
                return Err(GatewayError::Internal(
                    "the first send with this idempotency key has not finished".into(),
                ));
            }
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = self.shutdown.cancelled() => {
                    return Err(GatewayError::Internal("the gateway is shutting down".into()));
                }
            }
            pause = (pause * 2).min(Duration::from_millis(500));
            if let Some(key) = &ctx.idempotency_key {
                match self.ledger.claim_idempotency_peek(&ctx.principal, key)? {
                    // Released and claimed again, maybe for another message:
                    // this send goes back to claiming, which compares them.
                    Some(latest)
                        if latest.task_id != earlier.task_id
                            || latest.fingerprint != earlier.fingerprint =>
                    {
                        return Ok(None);
                    }
                    Some(latest) => earlier = latest,
                    None => return Ok(None),
                }
            }
        }
    }

    /// A new number for an idempotency claim a send of this run is about to
    /// make, held until the returned guard is dropped.
    fn hold_claim(self: &Arc<Self>) -> HeldClaim {
        let number = self.last_claim_number.fetch_add(1, Ordering::Relaxed) + 1;
        self.claims_held.lock().expect("claims lock").insert(number);
        HeldClaim {
            gateway: self.clone(),
            number,
        }
    }

    /// Whether a send still holds `claim`: one of this run that has not
    /// ended (an unnumbered claim of this run counts as held). A claim of
    /// an earlier run never is: no one will fill it.
    fn claim_is_held(&self, claim: &IdempotencyRecord) -> bool {
        if claim.claimed_by != self.ledger.instance() {
            return false;
        }
        claim.claim_number == 0
            || self
                .claims_held
                .lock()
                .expect("claims lock")
                .contains(&claim.claim_number)
    }

    /// Whether the send that claimed `earlier` did its part: answered with a
    /// message, or made its task, or (continuing a task with message
    /// `answer`) put that message in the task.
    fn claim_filled(
        &self,
        earlier: &IdempotencyRecord,
        answer: Option<&str>,
    ) -> Result<bool, GatewayError> {
        if earlier.message.is_some() {
            return Ok(true);
        }
        let Some(record) = self.ledger.get_shared(&earlier.task_id)? else {
            return Ok(false);
        };
        // Only what the task took since the claim: a messageId may be reused.
        let history = &record.task.history;
        let taken_since = history
            .get(earlier.history_from.unwrap_or(0)..)
            .unwrap_or_default();
        Ok(answer.is_none_or(|id| taken_since.iter().any(|message| message.message_id == id)))
    }
}

/// How long `value` is as JSON, counted as it is encoded, into no buffer.
fn encoded_len(value: &impl serde::Serialize) -> usize {
    /// Counts the bytes written to it.
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    serde_json::to_writer(&mut counter, value).map_or(0, |()| counter.0)
}

/// An idempotency claim a send of this run holds, from before it is
/// written until the send ends (its driver's end, or its own return): a
/// repeat waits while it is held, and takes the key over once the send
/// ended without filling it. Dropped on a panic too.
pub(super) struct HeldClaim {
    gateway: Arc<Gateway>,
    /// The claim's [`IdempotencyRecord::claim_number`].
    pub number: u64,
}

impl Drop for HeldClaim {
    fn drop(&mut self) {
        // Nothing panics under this lock; and a drop while unwinding must
        // not panic again.
        let mut held =
            (self.gateway.claims_held.lock()).unwrap_or_else(std::sync::PoisonError::into_inner);
        held.remove(&self.number);
    }
}

/// What a direct handoff decided before delivery.
#[derive(Clone, Debug, Default)]
struct Handoff {
    /// The payload's `handoffId`.
    handoff_id: Option<String>,
    /// How the agent was chosen.
    kind: HopKind,
    /// The skill the target was chosen by (`toSkill`, or a routing rule's).
    skill: Option<String>,
    /// The validated payload of an accepted handoff.
    payload: Option<Box<HandoffPayload>>,
    /// Why it is refused, if it is: the reason code and its detail.
    refusal: Option<(&'static str, serde_json::Value)>,
    /// A payload another gateway routed already, delivered here one hop on.
    relayed: bool,
}

impl Handoff {
    /// Whether the send hands work off (DESIGN.md §3.3): a payload's, or to
    /// the agent a routing rule chose; a plain call is none.
    fn is_handoff(&self) -> bool {
        self.payload.is_some() || self.kind == HopKind::Routed
    }

    fn refused(handoff_id: Option<String>, refusal: (&'static str, serde_json::Value)) -> Self {
        Self {
            handoff_id,
            refusal: Some(refusal),
            ..Self::default()
        }
    }
}

/// A completion whose artifacts fail the task's `returnSchema` becomes a
/// failure with `OUTPUT_SCHEMA_INVALID` and the violations (DESIGN.md §3.4).
/// `task` is the task before `events`; the events are applied to a copy to
/// see what the completion would leave.
pub(super) fn enforce_return_schema(
    task: &Task,
    schema: &serde_json::Value,
    mark: crate::store::ArtifactMark<'_>,
    events: &mut [StreamResponse],
) {
    let mut after = task.clone();
    for event in events.iter() {
        if crate::lifecycle::apply_event(&mut after, event).is_err() {
            return; // the ledger refuses the batch anyway
        }
    }
    if after.status.state != TaskState::Completed {
        return;
    }
    let checked = mark.made_since(&after.artifacts);
    let Err(violations) = crate::handoff::artifacts::check_artifacts(schema, &checked) else {
        return;
    };
    let Some(StreamResponse::StatusUpdate(completion)) = events
        .iter_mut()
        .rev()
        .find(|e| e.state() == Some(TaskState::Completed))
    else {
        return;
    };
    let mut status = Message::agent(vec![status_part(
        reasons::OUTPUT_SCHEMA_INVALID,
        violations_detail(&violations),
    )]);
    status.task_id = completion.task_id.clone();
    status.context_id = completion.context_id.clone();
    completion.status = TaskStatus::now(TaskState::Failed, Some(status));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_reply_serializes_as_a_send_message_response() {
        let task = Task {
            id: "t1".into(),
            context_id: "c1".into(),
            history: vec![
                Message {
                    message_id: "m1".into(),
                    ..Message::default()
                },
                Message {
                    message_id: "m2".into(),
                    ..Message::default()
                },
            ],
            artifacts: vec![Artifact {
                artifact_id: "a1".into(),
                ..Artifact::default()
            }],
            ..Task::default()
        };
        let record = Arc::new(TaskRecord {
            task: task.clone(),
            ..TaskRecord::default()
        });
        let task_json: Arc<serde_json::value::RawValue> =
            serde_json::value::to_raw_value(&task).unwrap().into();
        for history_length in [None, Some(0), Some(1), Some(2), Some(5)] {
            let response = SendMessageResponse::Task(task.view(history_length, true));
            let expected = serde_json::to_string(&response).unwrap();
            let reply = SendReply::Task(TaskReply::new(record.clone(), history_length));
            assert_eq!(serde_json::to_string(&reply).unwrap(), expected);
            // The same from the JSON the ledger write kept, whole or trimmed,
            // with or without the artifacts.
            for include_artifacts in [true, false] {
                let response =
                    SendMessageResponse::Task(task.view(history_length, include_artifacts));
                let read = crate::store::ReadTask {
                    record: record.clone(),
                    task_json: Some(task_json.clone()),
                    ticket: 0,
                };
                let reply = SendReply::Task(TaskReply::read(
                    crate::store::ReplyTask::Read(read),
                    history_length,
                    include_artifacts,
                ));
                assert_eq!(
                    serde_json::to_string(&reply).unwrap(),
                    serde_json::to_string(&response).unwrap(),
                    "{history_length:?} {include_artifacts}"
                );
            }
        }
        let message = task.history[0].clone();
        assert_eq!(
            serde_json::to_value(SendReply::Message(message.clone())).unwrap(),
            serde_json::to_value(SendMessageResponse::Message(message)).unwrap()
        );
    }
}
