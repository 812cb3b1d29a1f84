//! SendMessage and SendStreamingMessage: validation, continuation rules,
//! idempotency, and the driver that turns an agent's events into ledger
//! events.

use super::stream::TaskEventStream;
use super::validate::{self, check_history_length, check_message, finish};
use super::{CallContext, Gateway};
use crate::agents::{AgentEvent, AgentEvents, AgentRequest};
use crate::error::GatewayError;
use crate::handoff::control::{Control, Limits};
use crate::protocol::*;
use crate::registry::AgentEntry;
use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

/// An agent execution in progress.
type Execution = tokio::task::JoinHandle<Result<(), crate::agents::AgentError>>;
use crate::handoff::payload::{HandoffTarget, PayloadValidator, find_payload, violations_detail};
use crate::handoff::reasons::{self, status_part};
use crate::handoff::routing::{AgentView, RouteInput, agents_with_skill};
use crate::store::{IdempotencyRecord, TaskRecord};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, oneshot, watch};

/// What a send produced first.
enum First {
    /// The agent answered with a message; no task exists.
    Message(Message),
    /// The task exists in the ledger: created (`None`, its log starts with
    /// its snapshot) or continued (the record right after the continuation).
    Task(Option<Box<TaskRecord>>),
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
enum Begun {
    /// A new execution.
    Started(Started),
    /// An idempotent repeat: what the first send with the key produced.
    Replay(IdempotencyRecord),
    /// Refused before any agent saw it: the task is already terminal.
    Settled(Box<TaskRecord>),
}

/// A send whose agent is running.
struct Started {
    task_id: String,
    first: oneshot::Receiver<First>,
    watcher: broadcast::Receiver<Arc<crate::store::hub::LedgerEvent>>,
    driver_done: watch::Receiver<bool>,
}

fn fingerprint(agent_id: &str, message: &Message) -> String {
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
    ) -> Result<SendMessageResponse, GatewayError> {
        let config = req.configuration.clone().unwrap_or_default();
        let mut started = match self.start(ctx, req, false).await? {
            Begun::Started(started) => started,
            Begun::Replay(earlier) => return self.replay_send(ctx, earlier, &config).await,
            Begun::Settled(record) => {
                return Ok(SendMessageResponse::Task(
                    record.task.view(config.history_length, true),
                ));
            }
        };
        match (&mut started.first).await {
            Ok(First::Message(message)) => return Ok(SendMessageResponse::Message(message)),
            Ok(First::Error(err)) => return Err(err),
            Ok(First::Task(_)) => {}
            Err(_) => return Err(GatewayError::Internal("agent driver ended early".into())),
        }
        if !config.return_immediately {
            self.wait_settled(
                &started.task_id,
                &mut started.watcher,
                Some(&mut started.driver_done),
            )
            .await;
        }
        let record = self.owned_task(ctx, &started.task_id)?;
        Ok(SendMessageResponse::Task(
            record.task.view(config.history_length, true),
        ))
    }

    /// `SendStreamingMessage`.
    pub async fn send_streaming_message(
        self: &Arc<Self>,
        ctx: &CallContext,
        req: SendMessageRequest,
    ) -> Result<SendOutcome, GatewayError> {
        let mut started = match self.start(ctx, req, true).await? {
            Begun::Started(started) => started,
            Begun::Settled(record) => {
                let watcher = self.ledger.hub().watch(&record.task.id);
                return Ok(SendOutcome::Task(TaskEventStream::from_snapshot(
                    self.clone(),
                    *record,
                    watcher,
                    true,
                )));
            }
            Begun::Replay(earlier) => {
                if let Some(message) = earlier.message {
                    return Ok(SendOutcome::Message(message));
                }
                // Watch before reading, so no event falls between the two.
                let watcher = self.ledger.hub().watch(&earlier.task_id);
                self.ledger.sync().await;
                let record = self.owned_task(ctx, &earlier.task_id)?;
                return Ok(SendOutcome::Task(TaskEventStream::from_snapshot(
                    self.clone(),
                    record,
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
                *record,
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
    ) -> Result<SendMessageResponse, GatewayError> {
        if let Some(message) = earlier.message {
            return Ok(SendMessageResponse::Message(message));
        }
        if !config.return_immediately {
            let mut watcher = self.ledger.hub().watch(&earlier.task_id);
            self.wait_settled(&earlier.task_id, &mut watcher, None)
                .await;
        }
        let record = self.owned_task(ctx, &earlier.task_id)?;
        Ok(SendMessageResponse::Task(
            record.task.view(config.history_length, true),
        ))
    }

    /// Resolves a direct handoff (DESIGN.md §3.3): a message with a payload
    /// part goes to the payload's `to`, or to an agent with its `toSkill`.
    /// An invalid payload or an unknown target becomes a refusal (a REJECTED
    /// task); a `to` that contradicts the addressed agent is -32602.
    fn direct_handoff(
        &self,
        ctx: &CallContext,
        message: &Message,
        metadata: Option<&crate::protocol::wire::Struct>,
    ) -> Result<(String, Handoff), GatewayError> {
        let addressed = ctx.agent_id.clone();
        let Some(data) = find_payload(message) else {
            // Routed (§3.3): the rules choose when the caller named no agent.
            let routed = (!ctx.pinned)
                .then(|| self.route(message, metadata))
                .flatten();
            return Ok((routed.unwrap_or(addressed), Handoff::default()));
        };
        let payload = match PayloadValidator::shared().validate(data) {
            Ok(payload) => payload,
            Err(violations) => {
                let refusal = (reasons::SCHEMA_INVALID, violations_detail(&violations));
                return Ok((addressed, Handoff::refused(None, refusal)));
            }
        };
        let handoff_id = Some(payload.handoff_id.clone());
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
                    Ok((
                        to.clone(),
                        Handoff {
                            handoff_id,
                            refusal: None,
                        },
                    ))
                } else {
                    let refusal = (reasons::TARGET_NOT_FOUND, serde_json::json!({"to": to}));
                    Ok((to.clone(), Handoff::refused(handoff_id, refusal)))
                }
            }
            HandoffTarget::Skill(skill) => {
                let entries = self.directory().list();
                let views: Vec<AgentView> = entries
                    .iter()
                    .filter(|e| !ctx.pinned || e.id == addressed)
                    .map(|e| AgentView {
                        id: &e.id,
                        card: e.agent.card(),
                        healthy: true,
                    })
                    .collect();
                let candidates = agents_with_skill(skill, &views);
                if candidates.is_empty() {
                    let refusal = (
                        reasons::TARGET_NOT_FOUND,
                        serde_json::json!({"toSkill": skill}),
                    );
                    return Ok((addressed, Handoff::refused(handoff_id, refusal)));
                }
                // Balanced across the agents declaring the skill.
                let turn = self.next_balance() as usize % candidates.len();
                let target = candidates[turn].to_string();
                Ok((
                    target,
                    Handoff {
                        handoff_id,
                        refusal: None,
                    },
                ))
            }
        }
    }

    /// The agent the routing rules choose for a message, if any rule matches.
    fn route(
        &self,
        message: &Message,
        metadata: Option<&crate::protocol::wire::Struct>,
    ) -> Option<String> {
        let entries = self.directory().list();
        let views: Vec<AgentView> = entries
            .iter()
            .map(|e| AgentView {
                id: &e.id,
                card: e.agent.card(),
                healthy: true,
            })
            .collect();
        let input = RouteInput {
            tenant: None,
            message,
            metadata,
        };
        self.settings
            .routing
            .route(&input, &views, self.next_balance())
    }

    /// Records a task refused by policy: REJECTED at once, with the reason
    /// code in a status part, and never delivered.
    async fn reject(
        &self,
        ctx: &CallContext,
        agent_id: &str,
        message: Message,
        control: &Control,
        reason: &str,
        detail: serde_json::Value,
    ) -> Result<Begun, GatewayError> {
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
            parent_task_id: control.parent_task_id.clone(),
            created_at: chrono::Utc::now(),
            ..TaskRecord::default()
        };
        tracing::info!(task_id = %snapshot.id, agent = agent_id, reason, "handoff refused");
        let record = self
            .ledger
            .create(record, vec![StreamResponse::Task(snapshot)])
            .await?;
        Ok(Begun::Settled(Box::new(record)))
    }

    /// Checks a repeat against the first send with its key.
    async fn replay(
        &self,
        ctx: &CallContext,
        key: &str,
        claim: &IdempotencyRecord,
        earlier: IdempotencyRecord,
    ) -> Result<Begun, GatewayError> {
        if earlier.fingerprint != claim.fingerprint {
            return Err(GatewayError::invalid_field(
                "message",
                format!("idempotency key {key:?} was already used with a different message"),
            ));
        }
        let earlier = self.await_idempotent_result(ctx, earlier).await?;
        Ok(Begun::Replay(earlier))
    }

    /// Waits until the task is terminal or interrupted, its driver (if
    /// given) stops, or the task timeout passes.
    async fn wait_settled(
        &self,
        task_id: &str,
        watcher: &mut broadcast::Receiver<Arc<crate::store::hub::LedgerEvent>>,
        mut driver_done: Option<&mut watch::Receiver<bool>>,
    ) {
        let deadline = tokio::time::sleep(self.settings.task_timeout);
        tokio::pin!(deadline);
        loop {
            if let Ok(Some(record)) = self.ledger.get(task_id) {
                let state = record.task.status.state;
                if state.is_terminal() || state.is_interrupted() {
                    return;
                }
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
                // Any event means: look at the ledger again. An event may be a
                // late one from an earlier turn, so its state alone says nothing.
                event = watcher.recv() => match event {
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => {
                        *watcher = self.ledger.hub().watch(task_id);
                    }
                },
                _ = driver_changed => {}
                _ = &mut deadline => return,
                _ = self.shutdown.cancelled() => return,
            }
        }
    }

    /// Validates a send, resolves a continuation, claims the idempotency key
    /// and starts the agent.
    async fn start(
        self: &Arc<Self>,
        ctx: &CallContext,
        req: SendMessageRequest,
        streaming: bool,
    ) -> Result<Begun, GatewayError> {
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
            crate::push::check_config(
                push,
                "configuration.taskPushNotificationConfig.",
                &mut violations,
            );
        }
        finish(violations)?;

        // A continuation stays with the agent that holds the task.
        let continued = if message.task_id.is_empty() {
            None
        } else {
            Some(self.owned_task(ctx, &message.task_id)?)
        };
        let (agent_id, handoff) = match &continued {
            Some(record) => (record.agent.clone(), Handoff::default()),
            None => self.direct_handoff(ctx, &message, req.metadata.as_ref())?,
        };
        let fingerprint = fingerprint(&agent_id, &message);

        // A repeated idempotent send answers like the first, whatever the task
        // has become since; so this comes before the state checks.
        let task_id = continued
            .as_ref()
            .map_or_else(|| uuid::Uuid::now_v7().to_string(), |r| r.task.id.clone());
        let claim = IdempotencyRecord {
            fingerprint: fingerprint.clone(),
            task_id: task_id.clone(),
            message: None,
        };
        if let Some(key) = &ctx.idempotency_key
            && let Some(earlier) = self.ledger.claim_idempotency_peek(&ctx.principal, key)?
        {
            return self.replay(ctx, key, &claim, earlier).await;
        }

        if let Some(record) = &continued {
            let state = record.task.status.state;
            if state.is_terminal() {
                return Err(GatewayError::UnsupportedOperation(format!(
                    "task {} is in terminal state {} and accepts no more messages",
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
            Some(agent) => validate::check_input_modes(agent.agent.card(), &message)?,
            None if handoff.refusal.is_none() => {
                return Err(GatewayError::invalid_field(
                    "tenant",
                    format!("unknown agent {agent_id:?}"),
                ));
            }
            None => {}
        }

        if let Some(key) = &ctx.idempotency_key
            && let Some(earlier) = self
                .ledger
                .claim_idempotency(&ctx.principal, key, &claim)
                .await?
        {
            // Another send with this key claimed it since the peek above.
            return self.replay(ctx, key, &claim, earlier).await;
        }

        if continued.is_none() && message.context_id.is_empty() {
            message.context_id = uuid::Uuid::new_v4().to_string();
        }
        if let Some(record) = &continued {
            message.context_id = record.task.context_id.clone();
        }
        message.task_id = task_id.clone();

        if let Some(mut push) = config.task_push_notification_config.clone() {
            push.task_id = task_id.clone();
            push.tenant.clear();
            if push.id.is_empty() {
                push.id = uuid::Uuid::new_v4().to_string();
            }
            self.ledger.put_push_config(&push).await?;
        }

        // Handoff control (DESIGN.md §3.1): a new task is a new hop; a
        // continuation stays on the hop of its task.
        let control = match &continued {
            Some(record) => Control::read_from(record.task.metadata.as_ref()).unwrap_or_default(),
            None => {
                let mut incoming = ctx.incoming.clone();
                incoming.metadata = Control::read_from(message.metadata.as_ref());
                let lineage = incoming
                    .metadata
                    .as_ref()
                    .and_then(|c| c.parent_task_id.as_deref())
                    .and_then(|parent| self.owned_task(ctx, parent).ok())
                    .and_then(|parent| Control::read_from(parent.task.metadata.as_ref()));
                let limits = Limits {
                    max_hops: self.settings.max_hops,
                    task_timeout: self.settings.task_timeout,
                };
                let mut merged =
                    Control::merge(&incoming, lineage.as_ref(), limits, chrono::Utc::now());
                if handoff.handoff_id.is_some() {
                    merged.handoff_id = handoff.handoff_id.clone();
                }
                let refusal = handoff
                    .refusal
                    .clone()
                    .or_else(|| policy_refusal(&merged, &agent_id));
                if let Some((reason, detail)) = refusal {
                    let delivered = merged.delivered_to(&agent_id);
                    delivered.write_into(&mut message.metadata);
                    return self
                        .reject(ctx, &agent_id, message, &delivered, reason, detail)
                        .await;
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

        let watcher = self.ledger.hub().watch(&task_id);
        let (first_tx, first) = oneshot::channel();
        let (done_tx, driver_done) = watch::channel(false);
        let cancel = self.shutdown.child_token();
        let request = AgentRequest {
            task_id: task_id.clone(),
            context_id: message.context_id.clone(),
            message,
            task: continued.as_ref().map(|r| r.task.clone()),
            upstream: continued.as_ref().and_then(|r| r.upstream.clone()),
            streaming,
            accepted_output_modes: config.accepted_output_modes,
            cancel: cancel.clone(),
        };
        self.register_running(&task_id, cancel);
        let driver = Driver {
            gateway: self.clone(),
            agent,
            owner: ctx.principal.clone(),
            idempotency_key: ctx.idempotency_key.clone(),
            fingerprint,
        };
        tokio::spawn(async move {
            driver.run(request, continued, first_tx).await;
            let _ = done_tx.send(true);
        });
        Ok(Begun::Started(Started {
            task_id,
            first,
            watcher,
            driver_done,
        }))
    }

    /// Hands every task left SUBMITTED or WORKING by a previous run back to
    /// its agent, which resumes it or fails it with the reason. Returns how
    /// many tasks were picked up.
    pub async fn recover_in_flight(self: &Arc<Self>) -> Result<usize, GatewayError> {
        let ids = self.ledger.active_task_ids()?;
        let mut recovered = 0;
        for task_id in ids {
            let Some(record) = self.ledger.get(&task_id)? else {
                continue;
            };
            let Some(agent) = self.agent(&record.agent) else {
                tracing::warn!(task_id, agent = %record.agent, "in-flight task of an unknown agent");
                continue;
            };
            let driver = Driver {
                gateway: self.clone(),
                agent,
                owner: record.owner.clone(),
                idempotency_key: None,
                fingerprint: String::new(),
            };
            tokio::spawn(driver.recover(record));
            recovered += 1;
        }
        Ok(recovered)
    }

    /// A repeated send may arrive while the first is still deciding between
    /// a task and a message; wait briefly for the outcome.
    async fn await_idempotent_result(
        &self,
        ctx: &CallContext,
        mut earlier: IdempotencyRecord,
    ) -> Result<IdempotencyRecord, GatewayError> {
        for _ in 0..250 {
            if earlier.message.is_some() || self.owned_task(ctx, &earlier.task_id).is_ok() {
                return Ok(earlier);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            if let Some(key) = &ctx.idempotency_key
                && let Some(latest) = self.ledger.claim_idempotency_peek(&ctx.principal, key)?
            {
                earlier = latest;
            }
        }
        Err(GatewayError::Internal(
            "the first send with this idempotency key has not finished".into(),
        ))
    }
}

/// Runs one agent execution and records what it reports.
struct Driver {
    gateway: Arc<Gateway>,
    agent: Arc<AgentEntry>,
    owner: String,
    idempotency_key: Option<String>,
    fingerprint: String,
}

impl Driver {
    /// Picks up a task left SUBMITTED or WORKING by a previous run of the
    /// gateway; the agent either resumes it or the task fails with the reason.
    pub(crate) async fn recover(self, record: TaskRecord) {
        let (events, receiver) = AgentEvents::channel(64);
        let agent = self.agent.agent.clone();
        let task = record.task.clone();
        let upstream = record.upstream.clone();
        // Cancelable like any execution: by CancelTask and by shutdown.
        let cancel = self.gateway.shutdown.child_token();
        self.gateway.register_running(&task.id, cancel.clone());
        let agent_cancel = cancel.clone();
        let execution = tokio::spawn(async move {
            agent
                .recover(&task, upstream.as_ref(), events, agent_cancel)
                .await
        });
        let deadline = Control::read_from(record.task.metadata.as_ref()).and_then(|c| c.deadline);
        self.pump(
            &record.task.id,
            &record.task.context_id,
            None,
            receiver,
            (execution, cancel, deadline),
            None,
            true,
        )
        .await;
    }

    async fn run(
        self,
        request: AgentRequest,
        continued: Option<TaskRecord>,
        first_tx: oneshot::Sender<First>,
    ) {
        let task_id = request.task_id.clone();
        let context_id = request.context_id.clone();
        let user_message = request.message.clone();
        let cancel = request.cancel.clone();
        let deadline = Control::read_from(user_message.metadata.as_ref()).and_then(|c| c.deadline);
        let (events, receiver) = AgentEvents::channel(64);
        let agent = self.agent.agent.clone();
        let execution = tokio::spawn(async move { agent.execute(request, events).await });
        let mut first_tx = Some(first_tx);
        let mut created = false;

        if continued.is_some() {
            // The answer resumes the task: it is WORKING again until the agent says otherwise.
            let appended = self
                .gateway
                .ledger
                .update(&task_id, |record| {
                    record.task.history.push(user_message.clone());
                    if record.task.status.state == TaskState::Working {
                        return Ok::<_, GatewayError>(Vec::new());
                    }
                    Ok(vec![StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                        task_id: task_id.clone(),
                        context_id: context_id.clone(),
                        status: TaskStatus::now(TaskState::Working, None),
                        metadata: None,
                    })])
                })
                .await;
            match appended {
                Ok(record) => {
                    created = true;
                    send_first(&mut first_tx, First::Task(Some(Box::new(record))));
                }
                Err(err) => {
                    self.refuse(&mut first_tx, err).await;
                    execution.abort();
                    self.gateway.unregister_running(&task_id);
                    return;
                }
            }
        }

        self.pump(
            &task_id,
            &context_id,
            Some(user_message),
            receiver,
            (execution, cancel, deadline),
            first_tx,
            created,
        )
        .await;
    }

    /// Records what the agent reports until it is done, then its outcome.
    #[allow(clippy::too_many_arguments)]
    async fn pump(
        &self,
        task_id: &str,
        context_id: &str,
        user_message: Option<Message>,
        mut receiver: tokio::sync::mpsc::Receiver<AgentEvent>,
        (execution, cancel, deadline): (Execution, CancellationToken, Option<DateTime<Utc>>),
        mut first_tx: Option<oneshot::Sender<First>>,
        mut created: bool,
    ) {
        let (task_id, context_id) = (task_id.to_string(), context_id.to_string());
        let expiry = async {
            match deadline {
                Some(deadline) => {
                    let left = (deadline - Utc::now()).to_std().unwrap_or_default();
                    tokio::time::sleep(left).await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::pin!(expiry);
        loop {
            let event = tokio::select! {
                event = receiver.recv() => event,
                _ = &mut expiry => {
                    cancel.cancel();
                    if created {
                        self.expire(&task_id, &context_id).await;
                    } else {
                        let error = GatewayError::UpstreamTimeout(
                            "the task's deadline passed before the agent answered".into(),
                        );
                        self.refuse(&mut first_tx, error).await;
                    }
                    break;
                }
            };
            let Some(event) = event else {
                break;
            };
            let mut batch = vec![event];
            while let Ok(more) = receiver.try_recv() {
                batch.push(more);
            }
            if !created && matches!(batch[0], AgentEvent::Message(_)) {
                if let AgentEvent::Message(mut message) = batch.remove(0) {
                    message.context_id = context_id.clone();
                    message.task_id.clear();
                    self.record_direct_reply(&task_id, &message).await;
                    send_first(&mut first_tx, First::Message(message));
                    break;
                }
            }
            // The agent's own ids go with the record, not into the event log.
            let bound = batch.iter().rev().find_map(|event| match event {
                AgentEvent::Bound(upstream) => Some(upstream.clone()),
                _ => None,
            });
            let mut stream_events = Vec::with_capacity(batch.len() + 1);
            if !created {
                stream_events.push(StreamResponse::Task(Task {
                    id: task_id.clone(),
                    context_id: context_id.clone(),
                    status: TaskStatus::now(TaskState::Submitted, None),
                    history: user_message.iter().cloned().collect(),
                    metadata: user_message.as_ref().and_then(|m| {
                        let control = Control::read_from(m.metadata.as_ref())?;
                        let mut metadata = None;
                        control.write_into(&mut metadata);
                        metadata
                    }),
                    ..Task::default()
                }));
            }
            stream_events.extend(
                batch
                    .into_iter()
                    .filter_map(|event| to_stream_event(event, &task_id, &context_id)),
            );
            let result = if created {
                self.gateway
                    .ledger
                    .update(&task_id, |record| {
                        if bound.is_some() {
                            record.upstream = bound;
                        }
                        let mut stream_events = stream_events;
                        if let Some(schema) = &record.return_schema {
                            enforce_return_schema(&record.task, schema, &mut stream_events);
                        }
                        Ok::<_, GatewayError>(stream_events)
                    })
                    .await
            } else {
                self.create(&task_id, bound, stream_events).await
            };
            match result {
                Ok(_) if !created => {
                    created = true;
                    send_first(&mut first_tx, First::Task(None));
                }
                Ok(_) => {}
                Err(err) => {
                    // Typically a cancel that made the task terminal first.
                    tracing::debug!(task_id = %task_id, %err, "agent event not applied");
                    if !created {
                        self.refuse(&mut first_tx, err).await;
                    }
                    break;
                }
            }
        }
        drop(receiver);

        let outcome = execution.await;
        let failure = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(err)) => Some(err),
            Err(join) => Some(crate::agents::AgentError::Failed(format!(
                "agent execution panicked or was aborted: {join}"
            ))),
        };
        match (failure, created) {
            (Some(err), true) => {
                let reason = vec![Part::text(err.to_string())];
                self.fail(&task_id, &context_id, reason).await
            }
            (Some(err), false) => self.refuse(&mut first_tx, err.into()).await,
            (None, false) => {
                let error = GatewayError::InvalidAgentResponse(
                    "the agent ended without a task or a message".into(),
                );
                self.refuse(&mut first_tx, error).await
            }
            (None, true) => {}
        }
        self.gateway.unregister_running(&task_id);
    }

    /// The deadline passed: the agent is told to stop at once (`CancelTask`
    /// for a remote agent) and the task fails with `DEADLINE_EXCEEDED`.
    async fn expire(&self, task_id: &str, context_id: &str) {
        if let Ok(Some(record)) = self.gateway.ledger.get(task_id) {
            if record.task.status.state.is_terminal() {
                return;
            }
            if let Err(err) = self
                .agent
                .agent
                .cancel(&record.task, record.upstream.as_ref())
                .await
            {
                tracing::warn!(task_id, %err, "agent did not confirm the cancel at the deadline");
            }
        }
        let reason = status_part(reasons::DEADLINE_EXCEEDED, serde_json::json!({}));
        self.fail(task_id, context_id, vec![reason]).await;
    }

    /// Answers the caller with an error when nothing was created; the
    /// idempotency key is released so a retry reaches the agent again.
    async fn refuse(&self, first_tx: &mut Option<oneshot::Sender<First>>, error: GatewayError) {
        let Some(tx) = first_tx.take() else {
            return;
        };
        if let Some(key) = &self.idempotency_key
            && let Err(err) = self
                .gateway
                .ledger
                .release_idempotency(&self.owner, key)
                .await
        {
            tracing::error!(%err, "could not release an idempotency key");
        }
        let _ = tx.send(First::Error(error));
    }

    async fn create(
        &self,
        task_id: &str,
        upstream: Option<crate::agents::UpstreamRef>,
        events: Vec<StreamResponse>,
    ) -> Result<TaskRecord, GatewayError> {
        let Some(StreamResponse::Task(initial)) = events.first().cloned() else {
            return Err(GatewayError::Internal(
                "a new task starts with its snapshot".into(),
            ));
        };
        // The handoff graph: a child names its parent in its control.
        let parent_task_id =
            Control::read_from(initial.metadata.as_ref()).and_then(|c| c.parent_task_id);
        // A handoff asking for a typed result: its artifacts are checked.
        let return_schema = initial
            .history
            .first()
            .and_then(find_payload)
            .and_then(|payload| payload.get("returnSchema"))
            .cloned();
        let mut events = events;
        if let Some(schema) = &return_schema {
            let empty = Task {
                id: initial.id.clone(),
                ..Task::default()
            };
            enforce_return_schema(&empty, schema, &mut events);
        }
        // An empty record: applying the log's first event, the snapshot, fills it.
        let record = TaskRecord {
            task: Task {
                id: initial.id.clone(),
                context_id: initial.context_id.clone(),
                ..Task::default()
            },
            owner: self.owner.clone(),
            agent: self.agent.id.clone(),
            upstream,
            parent_task_id,
            return_schema,
            created_at: chrono::Utc::now(),
            ..TaskRecord::default()
        };
        debug_assert_eq!(initial.id, task_id);
        Ok(self.gateway.ledger.create(record, events).await?)
    }

    async fn record_direct_reply(&self, task_id: &str, message: &Message) {
        tracing::info!(task_id, agent = %self.agent.id, message_id = %message.message_id, "agent answered with a message; no task");
        if let Some(key) = &self.idempotency_key {
            let record = IdempotencyRecord {
                fingerprint: self.fingerprint.clone(),
                task_id: task_id.to_string(),
                message: Some(message.clone()),
            };
            if let Err(err) = self
                .gateway
                .ledger
                .complete_idempotency(&self.owner, key, &record)
                .await
            {
                tracing::error!(%err, "could not record idempotent reply");
            }
        }
    }

    /// Fails a task (unless it is terminal already) with a status message of `parts`.
    async fn fail(&self, task_id: &str, context_id: &str, parts: Vec<Part>) {
        let mut message = Message::agent(parts);
        message.task_id = task_id.to_string();
        message.context_id = context_id.to_string();
        let result = self
            .gateway
            .ledger
            .update(task_id, |record| {
                if record.task.status.state.is_terminal() {
                    return Ok::<_, GatewayError>(Vec::new());
                }
                Ok(vec![StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                    task_id: task_id.to_string(),
                    context_id: context_id.to_string(),
                    status: TaskStatus::now(TaskState::Failed, Some(message)),
                    metadata: None,
                })])
            })
            .await;
        if let Err(err) = result {
            tracing::error!(task_id, %err, "could not record agent failure");
        }
    }
}

fn send_first(first_tx: &mut Option<oneshot::Sender<First>>, first: First) {
    if let Some(tx) = first_tx.take() {
        let _ = tx.send(first);
    }
}

/// Turns an agent event into the ledger event for the task; `Bound` is no
/// event (the ids go into the record).
fn to_stream_event(event: AgentEvent, task_id: &str, context_id: &str) -> Option<StreamResponse> {
    let fill = |mut message: Message| {
        message.task_id = task_id.to_string();
        message.context_id = context_id.to_string();
        if message.role == Role::Unspecified {
            message.role = Role::Agent;
        }
        message
    };
    let event = match event {
        AgentEvent::Bound(_) => return None,
        AgentEvent::Status { state, message } => {
            StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                task_id: task_id.to_string(),
                context_id: context_id.to_string(),
                status: TaskStatus::now(state, message.map(fill)),
                metadata: None,
            })
        }
        AgentEvent::Artifact {
            artifact,
            append,
            last_chunk,
        } => StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
            task_id: task_id.to_string(),
            context_id: context_id.to_string(),
            artifact,
            append,
            last_chunk,
            metadata: None,
        }),
        // A message once a task exists is recorded as the task's reply.
        AgentEvent::Message(message) => StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: task_id.to_string(),
            context_id: context_id.to_string(),
            status: TaskStatus::now(TaskState::Completed, Some(fill(message))),
            metadata: None,
        }),
    };
    Some(event)
}

/// What a direct handoff decided before delivery.
#[derive(Clone, Debug, Default)]
struct Handoff {
    /// The payload's `handoffId`.
    handoff_id: Option<String>,
    /// Why it is refused, if it is: the reason code and its detail.
    refusal: Option<(&'static str, serde_json::Value)>,
}

impl Handoff {
    fn refused(handoff_id: Option<String>, refusal: (&'static str, serde_json::Value)) -> Self {
        Self {
            handoff_id,
            refusal: Some(refusal),
        }
    }
}

/// Why the policy refuses to deliver a line of work to `target`, if it does:
/// the hop limit is reached, or `target` already holds it (a cycle).
fn policy_refusal(control: &Control, target: &str) -> Option<(&'static str, serde_json::Value)> {
    if control.hops >= control.max_hops {
        return Some((
            reasons::HOP_LIMIT_EXCEEDED,
            serde_json::json!({"hops": control.hops, "maxHops": control.max_hops, "chain": control.chain}),
        ));
    }
    if control.chain.iter().any(|held| held == target) {
        return Some((
            reasons::HANDOFF_CYCLE,
            serde_json::json!({"target": target, "chain": control.chain}),
        ));
    }
    None
}

/// A completion whose artifacts fail the task's `returnSchema` becomes a
/// failure with `OUTPUT_SCHEMA_INVALID` and the violations (DESIGN.md §3.4).
/// `task` is the task before `events`; the events are applied to a copy to
/// see what the completion would leave.
fn enforce_return_schema(task: &Task, schema: &serde_json::Value, events: &mut [StreamResponse]) {
    let mut after = task.clone();
    for event in events.iter() {
        if crate::lifecycle::apply_event(&mut after, event).is_err() {
            return; // the ledger refuses the batch anyway
        }
    }
    if after.status.state != TaskState::Completed {
        return;
    }
    let Err(violations) = crate::handoff::artifacts::check_artifacts(schema, &after.artifacts)
    else {
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
