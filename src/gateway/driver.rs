//! The driver of one gateway task: it runs agent turns and turns what each
//! agent reports into ledger events.
//!
//! A task is held by one agent at a time. Each agent's **turn** ends when
//! the agent settles the task, stops acknowledging (the failure ladder in
//! `relay.rs` takes over), hands the task on with a payload (a transfer), or
//! completes a transfer whose result goes back to its source. The driver
//! loops over turns until the task settles, so the caller keeps one task id
//! and one open stream through every handoff.

use super::send::First;
use super::{Gateway, send::enforce_return_schema};
use crate::agents::{
    AgentError, AgentEvent, AgentEvents, AgentRequest, FollowUpReceiver, UpstreamRef,
};
use crate::error::GatewayError;
use crate::handoff::control::{Control, Incoming};
use crate::handoff::payload::{HANDOFF_MEDIA_TYPE, find_data};
use crate::handoff::reasons::{self, status_part};
use crate::lifecycle::TransitionError;
use crate::protocol::*;
use crate::registry::AgentEntry;
use crate::store::{
    ArtifactMark, Change, CreatedTask, HopKind, HopRecord, IdempotencyRecord, LedgerError,
    TaskLimit, TaskRecord,
};
use chrono::{DateTime, Utc};
use futures::FutureExt;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

/// An agent execution in progress, polled by the driver's own task rather
/// than spawned: the agent's events then reach the driver without a wake-up
/// of another task, and a relayed send costs one task fewer. While the
/// driver writes to the ledger the agent is not polled; what its upstream
/// sends meanwhile waits in hyper's buffers and the socket, and joins the
/// next durable write.
pub(super) struct Execution {
    future: Option<futures::future::BoxFuture<'static, Result<(), AgentError>>>,
    outcome: Option<Result<(), AgentError>>,
    /// The turn's token, which the agent watches.
    cancel: CancellationToken,
    /// The token is not a child of the task's, so that the execution may
    /// outlive the task once abandoned (see `Driver::run`); meanwhile the
    /// driver passes a cancel of the task on itself.
    detached: bool,
    /// Whether the agent was polled: a call not begun creates no task.
    begun: bool,
}

impl Execution {
    /// Runs `future` as the turn's agent execution, stopped with `cancel`;
    /// a panic in it is the agent's failure, not the driver's.
    fn new(
        future: impl Future<Output = Result<(), AgentError>> + Send + 'static,
        cancel: CancellationToken,
        detached: bool,
    ) -> Self {
        let caught = std::panic::AssertUnwindSafe(future)
            .catch_unwind()
            .map(|result| {
                result.unwrap_or_else(|_| {
                    Err(AgentError::Failed("the agent execution panicked".into()))
                })
            });
        Self {
            future: Some(caught.boxed()),
            outcome: None,
            cancel,
            detached,
            begun: false,
        }
    }

    /// Whether the execution still runs.
    fn running(&self) -> bool {
        self.future.is_some()
    }

    /// Drives the execution until it ends; keeps its outcome.
    async fn progress(&mut self) {
        if let Some(future) = self.future.as_mut() {
            self.begun = true;
            self.outcome = Some(future.await);
            self.future = None;
        }
    }

    /// Stops the execution where it is: cancels the turn and drops the
    /// agent's future, which ends its calls.
    fn abort(&mut self) {
        self.cancel.cancel();
        self.future = None;
    }

    /// Its outcome, running it to the end first; `None` if it was aborted.
    async fn finish(mut self) -> Option<Result<(), AgentError>> {
        self.progress().await;
        self.outcome
    }
}

/// One agent's turn holding a task.
#[derive(Clone)]
pub(super) struct Turn {
    /// The agent.
    pub agent: Arc<AgentEntry>,
    /// What it is asked; `cancel` is this turn's own token.
    pub request: AgentRequest,
    /// Handoff semantics: the agent must acknowledge within its ackTimeout
    /// (else the ladder), and a message reply completes the task.
    pub handoff: bool,
    /// The skill the agent was chosen by: the ladder may reroute by it.
    pub skill: Option<String>,
    /// Who handed the work off (a handoff's sender): an agent the ladder
    /// reroutes to must allow it, as the first choice had to.
    pub source: Option<String>,
}

/// How a task's first turn begins.
pub(super) enum Start {
    /// Created on the agent's first answer; a message reply creates none.
    New(HopKind),
    /// Created at acceptance (a handoff), SUBMITTED; the turn is its
    /// delivery's attempt number so many on the failure ladder.
    Accepted(u32),
    /// A message continues this task.
    Continued(Arc<TaskRecord>),
}

/// How an agent's turn ended.
pub(super) enum TurnEnd {
    /// The agent settled the task, or the task ended otherwise.
    Settled,
    /// The agent did not acknowledge: why.
    NoAck(String),
    /// The agent handed the task on with a payload.
    Transfer(TransferOffer),
    /// A transfer's target completed; these artifacts go back to the source
    /// its `record` names.
    Return {
        record: Arc<TaskRecord>,
        artifacts: Vec<Artifact>,
    },
    /// A returned result's source refused it into its own task, which it
    /// ended since it handed off: the result goes to its context instead.
    SourceTaskEnded,
}

/// A payload an agent answered with, and what it left its own task as.
pub(super) struct TransferOffer {
    /// The payload's data.
    pub data: serde_json::Value,
    /// The state the source left its own task in.
    pub state: TaskState,
}

/// Runs one gateway task's agent turns.
pub(super) struct Driver {
    pub gateway: Arc<Gateway>,
    pub owner: String,
    pub idempotency_key: Option<String>,
    pub fingerprint: String,
    pub task_id: String,
    pub context_id: String,
    /// Canceled by CancelTask and at shutdown; each turn's token is a child.
    pub task_cancel: CancellationToken,
    /// When the task's line of work must be done.
    pub deadline: Option<DateTime<Utc>>,
    /// The ackTimeout the task's control asks for, shorter than the
    /// gateway's or the agent's only (DESIGN.md §3.4).
    pub asked_ack_timeout: Option<Duration>,
    /// The task exists in the ledger.
    pub created: bool,
    /// Where the first outcome goes, until it is known.
    pub first_tx: Option<oneshot::Sender<First>>,
    /// Agents the ladder has given up on for this delivery.
    pub tried: Vec<String>,
    /// The task's state after the driver's last own write, when that was
    /// the last write; saves reading the record back at the end.
    pub last_state: Option<TaskState>,
    /// What the delivery took up since its first abandoned attempt, for
    /// that attempt's sweeper; `None` until an attempt is abandoned.
    pub adoptions: Option<watch::Sender<Adoptions>>,
    /// The push config the send stored for the task it is to create: taken
    /// back if the task is never made.
    pub new_task_push: Option<String>,
    /// The idempotency claim the send holds, let go of when the driver ends.
    pub _held_claim: Option<super::send::HeldClaim>,
}

/// The agents' tasks a delivery took up, as its abandoned attempts' sweepers
/// see them.
#[derive(Debug, Default)]
pub(super) struct Adoptions {
    /// Each agent's task the gateway task was bound to: agent id and the
    /// agent's task id, in order.
    pub bound: Vec<(String, String)>,
    /// The driver stopped: nothing more will be taken up.
    pub ended: bool,
    /// The agents' tasks a sweeper has canceled: two attempts an agent
    /// answered with the same task (it deduplicates) cancel it once.
    pub swept: std::sync::Mutex<std::collections::HashSet<(String, String)>>,
}

impl Adoptions {
    /// Whether `agent`'s task `task_id`, which an attempt abandoned after
    /// `seen` adoptions created, is an orphan to cancel. It is not while the
    /// delivery may still take it up: the retry goes to the same agent with
    /// the same messageId, and an agent that deduplicates answers it with
    /// that same task. Once a later attempt was taken up, or the driver
    /// stopped, a task not taken up never will be.
    pub fn orphans(&self, seen: usize, agent: &str, task_id: &str) -> Option<bool> {
        let adopted = |(a, t): &(String, String)| a == agent && t == task_id;
        if self.bound.iter().any(adopted) {
            return Some(false);
        }
        (self.ended || self.bound.len() > seen).then_some(true)
    }
}

impl Driver {
    /// Runs turns until the task settles.
    pub(super) async fn run(mut self, first: Turn, start: Start) {
        let mut hop_kind = HopKind::Call;
        let mut attempts = 1;
        let mut turn = first;
        // Whether the turn delivers an escalated handoff again.
        let mut redelivering = false;
        // Where the first turn takes follow-ups, if the resuming write set it.
        let mut resumed_follow_ups = None;
        match start {
            Start::New(kind) => hop_kind = kind,
            Start::Accepted(made) => {
                self.created = true;
                attempts = made;
            }
            Start::Continued(record) => {
                let Some((resumed, reopened, follow_ups)) = self.resume(&turn, &record).await
                else {
                    // The task waits as it did: at its limit it fails now,
                    // else its deadline is watched again.
                    self.gateway.unregister_running(&self.task_id);
                    self.settle_interrupted().await;
                    return;
                };
                resumed_follow_ups = follow_ups;
                // The caller's answer to an escalated handoff delivers it
                // again, with the answer the resumed task keeps for it.
                if reopened && let Some(redelivery) = self.redelivery(&resumed, &turn) {
                    turn = redelivery;
                    redelivering = true;
                }
            }
        }
        let mut handed_on = false;
        loop {
            handed_on |= turn.handoff;
            // A cancel between turns must not start the next one.
            if self.task_cancel.is_cancelled() {
                // Messages wait on no follower that will not run.
                drop(resumed_follow_ups.take());
                break;
            }
            let user_message = (!self.created).then(|| turn.request.message.clone());
            let (events, receiver) = AgentEvents::channel(64);
            let events = match resumed_follow_ups.take() {
                Some(follow_ups) => events.with_follow_ups(follow_ups),
                None => self
                    .gateway
                    .follow_ups_to(&self.task_id, &turn.agent, events),
            };
            let (events, handled) = counted(events);
            let agent = turn.agent.agent.clone();
            // Only a handoff's turn may be sent again (a retry or a reroute,
            // `next_attempt`); any other gives its message to the agent.
            let mut request = if turn.handoff {
                turn.request.clone()
            } else {
                turn.request.hand_over()
            };
            // An attempt that may create a task at the agent, if abandoned,
            // outlives a cancel of the gateway task to learn that task and
            // cancel it (`sweep_abandoned`); it still ends at shutdown.
            // (A return to a source whose task ended starts a new one: its
            // upstream names the context only.)
            let detached = turn.handoff
                && turn.agent.agent.creates_remote_tasks()
                && request
                    .upstream
                    .as_ref()
                    .is_none_or(|upstream| upstream.task_id.is_empty());
            if detached {
                request.cancel = self.gateway.shutdown.child_token();
            }
            // Only a return leg is a handoff into a task the agent holds; a
            // refusal of its retry may mean the source took the first
            // attempt and ended its task since, so only the first attempt's
            // may send the result to the context instead.
            // (A redelivery's earlier attempts may have been taken too.)
            let redelivered = std::mem::take(&mut redelivering);
            let into_task = turn.handoff
                && !detached
                && request.upstream.is_some()
                && attempts == 1
                && !redelivered;
            let cancel = request.cancel.clone();
            let execution = Execution::new(
                async move { agent.execute(request, events).await },
                cancel,
                detached,
            );
            let turn_started = std::time::Instant::now();
            let end = self
                .pump(
                    &turn.agent,
                    (turn.handoff, into_task),
                    (user_message, hop_kind),
                    (receiver, handled),
                    execution,
                )
                .await;
            if turn.handoff {
                let metrics = &self.gateway.metrics;
                metrics.round_trip(&turn.agent.id, turn_started.elapsed());
            }
            if !matches!(end, TurnEnd::Settled) {
                self.last_state = None;
            }
            let next = match end {
                TurnEnd::Settled => None,
                TurnEnd::NoAck(why) => self.next_attempt(turn, why, &mut attempts).await,
                TurnEnd::Transfer(offer) => {
                    attempts = 1;
                    self.tried.clear();
                    self.transfer(&turn, offer).await
                }
                TurnEnd::Return { record, artifacts } => {
                    attempts = 1;
                    self.tried.clear();
                    self.give_back(&turn, &record, artifacts).await
                }
                TurnEnd::SourceTaskEnded => self.return_to_context(turn).await,
            };
            match next {
                Some(next) => turn = next,
                None => break,
            }
        }
        self.settle_interrupted().await;
        self.release_waiting_sources().await;
        if handed_on {
            self.gateway.metrics_finished(&self.task_id);
        }
        if let Some(adoptions) = &self.adoptions {
            adoptions.send_modify(|adoptions| adoptions.ended = true);
        }
        self.gateway.unregister_running(&self.task_id);
    }

    /// Picks up a task left SUBMITTED or WORKING by a previous run of the
    /// gateway; the agent either resumes it or the task fails with the reason.
    pub(super) async fn recover(mut self, agent: Arc<AgentEntry>, record: TaskRecord) {
        // Its deadline passed while the gateway was down: it fails as it
        // would have (DESIGN.md §2), and the agent is told to stop.
        if self.deadline.is_some_and(|deadline| deadline <= Utc::now()) {
            self.expire(&agent).await;
            self.gateway.unregister_running(&self.task_id);
            return;
        }
        // A handoff its target had not acknowledged is a delivery without
        // an acknowledgement: on to the next step of the ladder.
        let next = match self.undelivered_handoff(&agent, &record) {
            Some((turn, mut attempts)) => {
                let why = "the gateway restarted before the agent acknowledged".to_string();
                let next = self.next_attempt(turn, why, &mut attempts).await;
                next.map(|next| (next, attempts))
            }
            None => self
                .follow_recovered(agent, record)
                .await
                .map(|next| (next, 1)),
        };
        if let Some((next, attempts)) = next {
            return self.run(next, Start::Accepted(attempts)).await;
        }
        self.settle_interrupted().await;
        self.release_waiting_sources().await;
        self.gateway.unregister_running(&self.task_id);
    }

    /// Has the agent pick its task up again and records what it reports.
    /// A transfer or a result to return found meanwhile goes on as it would
    /// have: both need only the ledger's record and the turn's agent.
    async fn follow_recovered(
        &mut self,
        agent: Arc<AgentEntry>,
        record: TaskRecord,
    ) -> Option<Turn> {
        let (events, receiver) = AgentEvents::channel(64);
        let events = self.gateway.follow_ups_to(&self.task_id, &agent, events);
        let (events, handled) = counted(events);
        let implementation = agent.agent.clone();
        let task = record.task;
        let upstream = record.upstream;
        let cancel = self.task_cancel.child_token();
        let agent_cancel = cancel.clone();
        let execution = Execution::new(
            async move {
                implementation
                    .recover(&task, upstream.as_ref(), events, agent_cancel)
                    .await
            },
            cancel,
            false,
        );
        let end = self
            .pump(
                &agent,
                (false, false),
                (None, HopKind::Call),
                (receiver, handled),
                execution,
            )
            .await;
        let recovered = Turn {
            agent,
            request: self.recovered_request(Message::default()),
            handoff: false,
            skill: None,
            source: None,
        };
        match end {
            TurnEnd::Settled => None,
            TurnEnd::Transfer(offer) => self.transfer(&recovered, offer).await,
            TurnEnd::Return { record, artifacts } => {
                self.give_back(&recovered, &record, artifacts).await
            }
            // Only a handoff's turn waits for an acknowledgement, and only
            // a return leg finds its source's task ended.
            TurnEnd::NoAck(why) => {
                self.fail(vec![Part::text(why)]).await;
                None
            }
            TurnEnd::SourceTaskEnded => None,
        }
    }

    /// A request for a task picked up at start-up: no caller streams or
    /// restricts the output modes any more.
    pub(super) fn recovered_request(&self, message: Message) -> AgentRequest {
        AgentRequest {
            task_id: self.task_id.clone(),
            context_id: self.context_id.clone(),
            message,
            task: None,
            upstream: None,
            streaming: false,
            accepted_output_modes: Vec::new(),
            cancel: self.task_cancel.child_token(),
        }
    }

    /// The answer resumes the task: it is WORKING again until the agent says
    /// otherwise. `None` when the task could not take the message; else the
    /// task as resumed, whether the answer reopened a handoff's delivery
    /// the ladder had escalated, and where the turn's agent takes follow-ups
    /// (registered with the write, so that a message to the task WORKING
    /// again finds the follower, not room for a second execution).
    async fn resume(
        &mut self,
        turn: &Turn,
        record: &TaskRecord,
    ) -> Option<(Arc<TaskRecord>, bool, Option<FollowUpReceiver>)> {
        let message = &turn.request.message;
        let (task_id, context_id) = (self.task_id.clone(), self.context_id.clone());
        let limits = self.gateway.settings.task_limits();
        let answers = record.task.status.state.is_interrupted();
        let mut reopened = false;
        let mut registered = None;
        let gateway = &self.gateway;
        // Limits the continuing caller shortened: decoded before the write
        // lock, kept by the task from now on, across a restart too.
        let asked = Incoming {
            metadata: Control::read_from(message.metadata.as_ref()),
            ..Incoming::default()
        };
        let appended = gateway
            .ledger
            .update_within(&task_id, limits, |current| {
                // However it is written, the agent's first report would
                // pass the limit.
                if current.last_seq >= limits.max_events {
                    let (events, limit) = (current.last_seq, limits.max_events);
                    return Err(LedgerError::TooManyEvents { events, limit });
                }
                // The task moved on to another agent (a transfer) since the
                // send read it: the message was meant for the one before.
                if !current.same_holder(record) {
                    return Err(TransitionError::HandedOnMeanwhile(current.agent.clone()).into());
                }
                // Another answer to the same question came first: this one
                // would start a second turn of the agent on one task.
                let now = current.task.status.state;
                if answers && !now.is_interrupted() {
                    return Err(TransitionError::AnsweredMeanwhile(now).into());
                }
                reopened = reopen_escalated_delivery(current);
                if let Some(stored) = &mut Control::read_from(current.task.metadata.as_ref())
                    && stored.shorten_to(&asked)
                {
                    stored.write_into(&mut current.task.metadata);
                }
                current.task.history.push(message.clone());
                registered = gateway.register_follower(&task_id, &turn.agent);
                if current.task.status.state == TaskState::Working {
                    return Ok::<_, LedgerError>(Vec::new());
                }
                Ok(vec![status_update(
                    &task_id,
                    &context_id,
                    TaskState::Working,
                    None,
                )])
            })
            .await
            .map_err(|err| continuation_refused(&task_id, err));
        debug_assert_eq!(record.task.id, self.task_id);
        match appended {
            Ok(updated) => {
                self.created = true;
                send_first(&mut self.first_tx, First::Task(Some(updated.clone())));
                Some((
                    updated,
                    reopened,
                    registered.map(|(follow_ups, _)| follow_ups),
                ))
            }
            Err(err) => {
                // Refused past the closure: the follower it displaced
                // follows on.
                if let Some((follow_ups, displaced)) = registered {
                    drop(follow_ups);
                    self.gateway.restore_follower(&task_id, displaced);
                }
                self.refuse(err).await;
                None
            }
        }
    }

    /// Records what `agent` reports until its turn ends; a `handoff`'s
    /// turn must be acknowledged, and one `into_task` the agent holds (a
    /// return leg) may find that task ended.
    async fn pump(
        &mut self,
        agent: &Arc<AgentEntry>,
        (handoff, into_task): (bool, bool),
        (mut user_message, hop_kind): (Option<Message>, HopKind),
        (mut receiver, handled): (mpsc::Receiver<AgentEvent>, Option<watch::Sender<u64>>),
        mut execution: Execution,
    ) -> TurnEnd {
        // How many of the agent's events were handled, for a follow-up to
        // be forwarded after them (`AgentEvents::until_handled`).
        let (mut received, mut published) = (0, 0);
        let expiry = until(self.deadline);
        tokio::pin!(expiry);
        let ack_timeout = handoff.then(|| {
            let ack_timeout = self.gateway.ack_timeout(agent);
            self.asked_ack_timeout
                .map_or(ack_timeout, |asked| asked.min(ack_timeout))
        });
        let ack_timer = tokio::time::sleep(ack_timeout.unwrap_or(Duration::MAX / 4));
        tokio::pin!(ack_timer);
        let turn_started = std::time::Instant::now();
        let mut acked = false;
        let returns = match self.returns_to_source() {
            Ok(returns) => returns,
            // Unknown, its completion could be taken for the caller's.
            Err(err) => {
                execution.abort();
                let reason = format!("the task could not be read: {err}");
                self.fail(vec![Part::text(reason)]).await;
                return TurnEnd::Settled;
            }
        };
        // Whether the task has result schemas, once a write of this turn saw.
        let mut checks_results: Option<bool> = None;
        loop {
            // Every event received before is handled by now.
            if let Some(handled) = &handled
                && received != published
            {
                handled.send_replace(received);
                published = received;
            }
            let event = tokio::select! {
                // An answer already queued counts before any timer.
                biased;
                event = receiver.recv() => event,
                // As a child token would be: the agent's work ends with the
                // task, before the agent is polled again. Before it answered,
                // the call goes on instead, to learn the task it may create
                // and cancel it (the cancel found no upstream task to reach).
                () = self.task_cancel.cancelled(), if execution.detached && !execution.cancel.is_cancelled() => {
                    if acked {
                        execution.cancel.cancel();
                        continue;
                    }
                    self.sweep_abandoned(agent.clone(), execution, receiver);
                    return TurnEnd::Settled;
                }
                // Before the agent's progress: one whose deadline passed
                // before its turn began is never called.
                _ = &mut expiry => {
                    // As at a cancel: a task the agent has not named yet is
                    // learned and canceled.
                    if execution.detached && execution.begun && !acked {
                        self.sweep_abandoned(agent.clone(), execution, receiver);
                    } else {
                        execution.abort();
                    }
                    if self.created {
                        self.expire(agent).await;
                    } else {
                        let error = GatewayError::UpstreamTimeout {
                            detail: "the task's deadline passed before the agent answered".into(),
                            agent: Some(agent.id.clone()),
                        };
                        self.refuse(error).await;
                    }
                    return TurnEnd::Settled;
                }
                // The agent runs here; its end closes the channel, which
                // ends this loop once its last events are in.
                () = execution.progress(), if execution.running() => continue,
                _ = &mut ack_timer, if ack_timeout.is_some() && !acked => {
                    // A turn continuing the agent's task creates none.
                    if execution.detached {
                        self.sweep_abandoned(agent.clone(), execution, receiver);
                    } else {
                        execution.abort();
                    }
                    let waited = ack_timeout.unwrap_or_default().as_millis();
                    return TurnEnd::NoAck(format!("no answer within the ackTimeout of {waited} ms"));
                }
            };
            let Some(event) = event else {
                break;
            };
            let mut batch = vec![event];
            // An agent reports several events at once (its ids, artifacts, a
            // status); those already queued share one durable write.
            while let Ok(more) = receiver.try_recv() {
                batch.push(more);
            }
            received += batch.len() as u64;
            let first_answer = !acked;
            if first_answer {
                acked = true;
                if handoff {
                    let metrics = &self.gateway.metrics;
                    metrics.acknowledged(&agent.id, turn_started.elapsed());
                }
            }
            if let Some(found) = find_transfer(&batch, &agent.id) {
                // A payload in an artifact may come a moment before the
                // status the source leaves its own task in: that decides
                // where a returned result goes (DESIGN.md §3.3).
                // A follow-up waiting for this batch goes on meanwhile: the
                // wait needs the follower reading its stream again.
                if let Some(handled) = &handled {
                    handled.send_replace(u64::MAX);
                }
                let state = match found.said {
                    Some(state) => Some(state),
                    None => tokio::time::timeout(
                        TRANSFER_STATUS_WAIT,
                        next_state(&mut receiver, &mut execution, &mut batch),
                    )
                    .await
                    .ok()
                    .flatten(),
                };
                let offer = TransferOffer {
                    data: found.data,
                    state: state.or(found.before).unwrap_or(TaskState::Working),
                };
                execution.abort();
                let bound = last_bound(&batch);
                self.adopt(&agent.id, bound.as_ref());
                // Results the source reported with its transfer are the
                // task's; the event that carried the payload is spent.
                let reported: Vec<StreamResponse> = batch
                    .into_iter()
                    .filter(|event| match event {
                        AgentEvent::Artifact { artifact, .. } => {
                            find_data(&artifact.parts, HANDOFF_MEDIA_TYPE).is_none()
                        }
                        _ => false,
                    })
                    .filter_map(|event| to_stream_event(event, &self.task_id, &self.context_id))
                    .collect();
                if !self.created {
                    let mut events = vec![self.snapshot(user_message.take())];
                    events.extend(reported);
                    let hop = first_hop(agent, hop_kind);
                    match self.create(agent, hop, bound, events).await {
                        Ok(CreatedTask {
                            cut: Some(exceeded),
                            ..
                        }) => {
                            self.stop_cut_at_creation(agent, exceeded).await;
                            return TurnEnd::Settled;
                        }
                        Ok(_) => {
                            self.created = true;
                            send_first(&mut self.first_tx, First::Task(None));
                        }
                        Err(err) => {
                            self.refuse(err).await;
                            return TurnEnd::Settled;
                        }
                    }
                } else if bound.is_some() || !reported.is_empty() {
                    let limits = self.gateway.settings.task_limits();
                    let written = self
                        .gateway
                        .ledger
                        .update_within(&self.task_id, limits, |record| {
                            if bound.is_some() {
                                record.upstream = bound.clone();
                            }
                            Ok::<_, ReportError>(reported)
                        })
                        .await;
                    if let Err(ReportError::PastLimit(exceeded)) = written {
                        self.stop_past_limit(agent, bound, exceeded).await;
                        return TurnEnd::Settled;
                    }
                }
                return TurnEnd::Transfer(offer);
            }
            // Said for a transfer's sake only: alone, it is no report.
            batch.retain(|event| !matches!(event, AgentEvent::StillIn(_)));
            if batch.is_empty() {
                continue;
            }
            if !self.created && matches!(batch[0], AgentEvent::Message(_)) {
                if let AgentEvent::Message(mut message) = batch.remove(0) {
                    message.context_id = self.context_id.clone();
                    message.task_id.clear();
                    self.record_direct_reply(agent, &message).await;
                    send_first(&mut self.first_tx, First::Message(message));
                    break;
                }
            }
            // The agent's own ids go with the record, not into the event log.
            let bound = last_bound(&batch);
            self.adopt(&agent.id, bound.as_ref());
            // A handoff's reply, or a returning target's, is a result to keep.
            if handoff || returns {
                batch = batch.into_iter().flat_map(reply_as_response).collect();
            }
            let mut stream_events = Vec::with_capacity(batch.len() + 1);
            if !self.created {
                stream_events.push(self.snapshot(user_message.take()));
            }
            stream_events.extend(
                batch
                    .into_iter()
                    .filter_map(|event| to_stream_event(event, &self.task_id, &self.context_id)),
            );
            // A transfer's target completing hands the result back instead.
            let returning = returns
                && stream_events
                    .iter()
                    .any(|e| e.state() == Some(TaskState::Completed));
            if returning {
                stream_events.retain(|e| e.state() != Some(TaskState::Completed));
            }
            let result = if self.created {
                let now = Utc::now();
                let limits = self.gateway.settings.task_limits();
                let report = Report {
                    acked_now: handoff && first_answer,
                    returning,
                };
                // A completion's result is checked against the task's schemas
                // before the ledger's lock, which every task's writes share;
                // under it only if the task changed meanwhile.
                let completes = stream_events
                    .iter()
                    .any(|e| e.state() == Some(TaskState::Completed));
                let prepared = (completes && !returning && checks_results != Some(false))
                    .then(|| self.check_results_ahead(report, &stream_events))
                    .flatten();
                let mut has_schemas = false;
                let written = self
                    .gateway
                    .ledger
                    .update_within(&self.task_id, limits, |record| {
                        if bound.is_some() {
                            record.upstream = bound.clone();
                        }
                        has_schemas = record.result_schemas().next().is_some();
                        let stream_events = match prepared {
                            Some((seq, prepared)) if seq == record.last_seq => prepared,
                            _ => report.prepare(record, stream_events),
                        };
                        note_hop(record, &stream_events, first_answer, now);
                        Ok::<_, ReportError>(stream_events)
                    })
                    .await;
                checks_results = Some(has_schemas);
                match written {
                    Err(ReportError::PastLimit(exceeded)) => {
                        execution.abort();
                        self.stop_past_limit(agent, bound, exceeded).await;
                        return TurnEnd::Settled;
                    }
                    Err(ReportError::Other(err)) => Err(err),
                    Ok(record) => Ok(record),
                }
            } else {
                let hop = first_hop(agent, hop_kind);
                match self.create(agent, hop, bound, stream_events).await {
                    Ok(CreatedTask {
                        cut: Some(exceeded),
                        ..
                    }) => {
                        execution.abort();
                        self.stop_cut_at_creation(agent, exceeded).await;
                        return TurnEnd::Settled;
                    }
                    created => created.map(|created| created.record),
                }
            };
            let record = match result {
                Ok(record) if !self.created => {
                    self.last_state = Some(record.task.status.state);
                    self.created = true;
                    send_first(&mut self.first_tx, First::Task(None));
                    record
                }
                Ok(record) => {
                    self.last_state = Some(record.task.status.state);
                    record
                }
                Err(err) => {
                    // Typically a cancel that made the task terminal first;
                    // anything else must not leave the task open with no driver.
                    tracing::debug!(task_id = %self.task_id, %err, "agent event not applied");
                    execution.abort();
                    if self.created {
                        let reason = format!("the agent's report could not be recorded: {err}");
                        self.fail(vec![Part::text(reason)]).await;
                    } else {
                        self.refuse(err).await;
                    }
                    break;
                }
            };
            if returning {
                execution.abort();
                return self.result_of_turn(record).await;
            }
        }
        drop(receiver);

        let failure = execution.finish().await.and_then(Result::err);
        match (failure, self.created) {
            (Some(err @ (AgentError::Unreachable(_) | AgentError::Timeout(_))), _)
                if handoff && !acked =>
            {
                TurnEnd::NoAck(err.to_string())
            }
            // Task not found (-32001), or not open to messages (-32004).
            (
                Some(AgentError::Refused {
                    code: -32001 | -32004,
                    ..
                }),
                true,
            ) if into_task && !acked => TurnEnd::SourceTaskEnded,
            (Some(err), true) => {
                self.fail(agent_failure(&agent.id, &err)).await;
                TurnEnd::Settled
            }
            (Some(err), false) => {
                self.refuse(GatewayError::from(err).about_agent(&agent.id))
                    .await;
                TurnEnd::Settled
            }
            (None, false) => {
                if self.first_tx.is_some() {
                    let error = GatewayError::invalid_agent_response(
                        "the agent ended without a task or a message",
                    )
                    .about_agent(&agent.id);
                    self.refuse(error).await;
                }
                TurnEnd::Settled
            }
            (None, true) => TurnEnd::Settled,
        }
    }

    /// Hands an attempt the ladder gave up on, or one a cancel or the
    /// deadline ended before the agent answered, to a sweeper of its own.
    /// The agent may still answer it with a task it created; that task is
    /// sent CancelTask unless the delivery takes it up (DESIGN.md §3.3).
    fn sweep_abandoned(
        &mut self,
        agent: Arc<AgentEntry>,
        mut execution: Execution,
        mut receiver: mpsc::Receiver<AgentEvent>,
    ) {
        let adoptions = self
            .adoptions
            .get_or_insert_with(|| watch::channel(Adoptions::default()).0);
        let seen = adoptions.borrow().bound.len();
        let mut verdict = adoptions.subscribe();
        let task_id = self.task_id.clone();
        tokio::spawn(async move {
            let answered = async {
                loop {
                    tokio::select! {
                        event = receiver.recv() => match event {
                            Some(AgentEvent::Bound(upstream)) => return Some(upstream),
                            Some(_) => {}
                            None => return None,
                        },
                        () = execution.progress(), if execution.running() => {}
                    }
                }
            };
            let created = tokio::time::timeout(ABANDONED_ANSWER_WAIT, answered)
                .await
                .ok()
                .flatten();
            execution.abort();
            drop(receiver);
            let Some(upstream) = created else {
                return;
            };
            let orphans =
                |adoptions: &Adoptions| adoptions.orphans(seen, &agent.id, &upstream.task_id);
            // A driver gone without a word takes nothing up any more.
            let orphan = match verdict.wait_for(|a| orphans(a).is_some()).await {
                Ok(adoptions) => orphans(&adoptions) == Some(true),
                Err(_) => true,
            };
            let first = orphan
                && verdict
                    .borrow()
                    .swept
                    .lock()
                    .expect("sweep lock")
                    .insert((agent.id.clone(), upstream.task_id.clone()));
            if !first {
                return;
            }
            let task = Task {
                id: task_id,
                ..Task::default()
            };
            match agent.agent.cancel(&task, Some(&upstream)).await {
                Ok(()) => {
                    tracing::info!(task_id = %task.id, agent = %agent.id, upstream_task = %upstream.task_id, "canceled the task of an abandoned attempt");
                }
                Err(err) => {
                    tracing::warn!(task_id = %task.id, agent = %agent.id, upstream_task = %upstream.task_id, %err, "the task of an abandoned attempt was not canceled");
                }
            }
        });
    }

    /// Tells the sweepers of abandoned attempts, if any, that `agent`'s task
    /// `bound` was taken up.
    fn adopt(&self, agent: &str, bound: Option<&UpstreamRef>) {
        if let (Some(adoptions), Some(bound)) = (&self.adoptions, bound) {
            adoptions.send_modify(|adoptions| {
                adoptions
                    .bound
                    .push((agent.to_string(), bound.task_id.clone()));
            });
        }
    }

    /// Whether the agent holding the task is a transfer's target whose
    /// result goes back to the source.
    fn returns_to_source(&self) -> Result<bool, LedgerError> {
        if !self.created {
            return Ok(false);
        }
        let record = self.gateway.ledger.get_shared(&self.task_id)?;
        Ok(record.is_some_and(|record| {
            record
                .transfer
                .as_ref()
                .is_some_and(|t| t.result_goes_to().is_some())
        }))
    }

    /// A returning target's result, from the `record` its completion left:
    /// its artifacts, once they satisfy the handoff's returnSchema (else the
    /// task fails with the violations).
    async fn result_of_turn(&mut self, record: Arc<TaskRecord>) -> TurnEnd {
        let transfer = record.transfer.as_ref();
        let artifacts = &record.task.artifacts;
        // The source gets every artifact made (or changed) since it handed
        // the task on, also by agents its target handed on to without a
        // return.
        let returned_mark =
            transfer
                .and_then(|t| t.result_goes_to())
                .map_or(record.schema_mark(), |t| ArtifactMark {
                    from: t.artifacts_before,
                    digests: &t.before_digests,
                });
        // The holder's own artifacts against its handoff's schema (and those
        // of holders that handed on to it for good); all the source gets
        // against the source's, when that is another handoff.
        let returned = transfer
            .and_then(|t| t.returned_schema())
            .map(|schema| (schema, returned_mark));
        for (schema, mark) in record.result_schemas().chain(returned) {
            if let Err(violations) =
                crate::handoff::artifacts::check_artifacts(schema, &mark.made_since(artifacts))
            {
                let detail = crate::handoff::payload::violations_detail(&violations);
                self.fail(vec![status_part(reasons::OUTPUT_SCHEMA_INVALID, detail)])
                    .await;
                return TurnEnd::Settled;
            }
        }
        let artifacts = returned_mark
            .made_since(artifacts)
            .into_iter()
            .map(|(_, artifact)| artifact.clone())
            .collect();
        TurnEnd::Return { record, artifacts }
    }

    /// The first event of a task created on the agent's first answer.
    fn snapshot(&self, user_message: Option<Message>) -> StreamResponse {
        let metadata = user_message
            .as_ref()
            .and_then(|m| Control::entry_alone(m.metadata.as_ref()));
        StreamResponse::Task(Task {
            id: self.task_id.clone(),
            context_id: self.context_id.clone(),
            status: TaskStatus::now(TaskState::Submitted, None),
            history: user_message.into_iter().collect(),
            metadata,
            ..Task::default()
        })
    }

    /// The deadline passed: the agent is told to stop at once (`CancelTask`
    /// for a remote agent) and the task fails with `DEADLINE_EXCEEDED`.
    pub(super) async fn expire(&mut self, agent: &Arc<AgentEntry>) {
        self.last_state = None;
        expire_task(&self.gateway, Some(agent), &self.task_id).await;
    }

    /// The agent reported more than the task may hold: of that report only
    /// its ids (`bound`) are written, so that its CancelTask reaches its
    /// task; it is told to stop, as at the deadline, and the task fails with
    /// `EVENT_LIMIT_EXCEEDED` or `TASK_SIZE_EXCEEDED`. The ids are a write
    /// of their own, durable before the cancel goes out, so that a restart
    /// during the stop still knows the agent's task.
    async fn stop_past_limit(
        &mut self,
        agent: &Arc<AgentEntry>,
        bound: Option<UpstreamRef>,
        exceeded: TaskLimit,
    ) {
        if let Some(bound) = bound {
            let ids = |record: &mut TaskRecord| {
                record.upstream = Some(bound);
                Ok::<_, GatewayError>(Vec::new())
            };
            let _ = self.gateway.ledger.update(&self.task_id, ids).await;
        }
        self.last_state = None;
        let settings = &self.gateway.settings;
        let (reason, limit) = match exceeded {
            TaskLimit::Events => {
                let limit = settings.max_task_events;
                let detail = json!({ "limit": limit });
                (status_part(reasons::EVENT_LIMIT_EXCEEDED, detail), limit)
            }
            TaskLimit::Bytes => {
                let limit = settings.max_task_bytes as u64;
                let detail = json!({ "limitBytes": limit });
                (status_part(reasons::TASK_SIZE_EXCEEDED, detail), limit)
            }
        };
        tracing::warn!(
            task_id = %self.task_id,
            agent = %agent.id,
            ?exceeded,
            limit,
            "the agent reported more than a task may hold; stopping it"
        );
        stop_task(&self.gateway, Some(agent), &self.task_id, reason).await;
    }

    /// The task was created from its snapshot alone, the agent's first
    /// report being past `exceeded`: the caller gets the task, and the
    /// agent is stopped (its ids came with the creation).
    async fn stop_cut_at_creation(&mut self, agent: &Arc<AgentEntry>, exceeded: TaskLimit) {
        self.created = true;
        send_first(&mut self.first_tx, First::Task(None));
        self.stop_past_limit(agent, None, exceeded).await;
    }

    /// Answers the caller with an error when nothing was created; the
    /// idempotency key is released so a retry reaches the agent again, and
    /// a push config stored for the task that never came is taken back.
    pub(super) async fn refuse(&mut self, error: GatewayError) {
        let Some(tx) = self.first_tx.take() else {
            return;
        };
        self.release_key().await;
        if let Some(config_id) = self.new_task_push.take().filter(|_| !self.created) {
            self.gateway
                .take_back_push_config(&self.task_id, &config_id)
                .await;
        }
        let _ = tx.send(First::Error(error));
    }

    /// Releases the caller's idempotency key, if it gave one.
    async fn release_key(&self) {
        let key = self.idempotency_key.as_deref();
        self.gateway.release_key(&self.owner, key).await;
    }

    /// Creates the task on its agent's first report. A report past the
    /// task's limits is left out (`cut`): the task holds the caller's
    /// message, and its agent is to be stopped.
    async fn create(
        &self,
        agent: &AgentEntry,
        hop: HopRecord,
        upstream: Option<UpstreamRef>,
        events: Vec<StreamResponse>,
    ) -> Result<CreatedTask, GatewayError> {
        let Some(StreamResponse::Task(initial)) = events.first() else {
            return Err(GatewayError::Internal(
                "a new task starts with its snapshot".into(),
            ));
        };
        // The handoff graph: a child names its parent in its control.
        let parent_task_id = self.gateway.linked_parent(
            &self.owner,
            Control::parent_task_id_in(initial.metadata.as_ref()),
        );
        let mut hop = hop;
        hop.acked_at = Some(Utc::now());
        hop.upstream_task_id = upstream.as_ref().map(|u| u.task_id.clone());
        // An empty record: applying the log's first event, the snapshot, fills it.
        let mut record = TaskRecord {
            task: Task {
                id: initial.id.clone(),
                context_id: initial.context_id.clone(),
                ..Task::default()
            },
            owner: self.owner.clone(),
            agent: agent.id.clone(),
            upstream,
            parent_task_id,
            created_at: Utc::now(),
            hops: vec![hop],
            ..TaskRecord::default()
        };
        note_hop(&mut record, &events, false, Utc::now());
        let limits = self.gateway.settings.task_limits();
        let parent = record.parent_task_id.clone();
        let created = self
            .gateway
            .ledger
            .create_within(record, events, limits)
            .await?;
        self.gateway.join_canceled_parent(parent.as_deref()).await;
        Ok(created)
    }

    async fn record_direct_reply(&self, agent: &AgentEntry, message: &Message) {
        tracing::info!(task_id = %self.task_id, agent = %agent.id, message_id = %message.message_id, "agent answered with a message; no task");
        if let Some(key) = &self.idempotency_key {
            let record = IdempotencyRecord {
                fingerprint: self.fingerprint.clone(),
                task_id: self.task_id.clone(),
                message: Some(message.clone()),
                claimed_by: self.gateway.ledger.instance(),
                history_from: None,
                claim_number: 0,
            };
            if let Err(err) = self
                .gateway
                .ledger
                .complete_idempotency(&self.owner, key, &record)
                .await
            {
                // Left claimed, with neither task nor message, the key would
                // hold every repeat until a restart: a repeat runs instead.
                tracing::error!(%err, "could not record idempotent reply; the key is released");
                self.release_key().await;
            }
        }
    }

    /// Fails the task (unless it is terminal already) with a status message of `parts`.
    pub(super) async fn fail(&mut self, parts: Vec<Part>) {
        self.settle(TaskState::Failed, parts).await;
    }

    /// Moves the task to `state` (unless it is terminal already) with a
    /// status message of `parts`.
    pub(super) async fn settle(&mut self, state: TaskState, parts: Vec<Part>) {
        self.last_state = None;
        settle_task(&self.gateway, &self.task_id, state, parts).await;
    }

    /// A task that ended short of its result (failed, rejected, or
    /// canceled) while sources waited for it: their paused tasks end too.
    async fn release_waiting_sources(&self) {
        if self
            .last_state
            .is_some_and(|state| state == TaskState::Completed || !state.is_terminal())
        {
            return;
        }
        if let Ok(Some(record)) = self.gateway.ledger.get_shared(&self.task_id)
            && record.task.status.state.is_terminal()
            && record.task.status.state != TaskState::Completed
        {
            self.gateway.release_paused_sources(&self.task_id).await;
        }
    }

    /// Once the turns are over, a task left waiting for input: nobody
    /// drives it, so a timer fails it when its deadline passes; one that
    /// holds the most events it may can take no answer (resuming it would
    /// pass the limit), so it fails now with `EVENT_LIMIT_EXCEEDED`, its
    /// agent told to stop, instead of waiting.
    async fn settle_interrupted(&mut self) {
        if self.last_state.is_some_and(|state| !state.is_interrupted()) {
            return;
        }
        let Ok(Some(record)) = self.gateway.ledger.get_shared(&self.task_id) else {
            return;
        };
        if !record.task.status.state.is_interrupted() {
            return;
        }
        let limit = self.gateway.settings.max_task_events;
        if record.last_seq >= limit {
            self.last_state = None;
            tracing::warn!(task_id = %self.task_id, limit, "a task waiting for input holds the most events it may; failing it");
            let agent = self.gateway.agent(&record.agent);
            let reason = status_part(reasons::EVENT_LIMIT_EXCEEDED, json!({ "limit": limit }));
            stop_task(&self.gateway, agent.as_deref(), &self.task_id, reason).await;
            return;
        }
        if let Some(deadline) = self.deadline {
            self.gateway
                .clone()
                .expire_at_deadline(self.task_id.clone(), deadline);
        }
    }
}

/// How an agent's report is written into its task.
#[derive(Clone, Copy)]
struct Report {
    /// A handoff's target answers for the first time.
    acked_now: bool,
    /// A transfer's target completes: the result goes back to the source,
    /// unchecked here.
    returning: bool,
}

impl Report {
    /// `events` as they go into `record`: a handoff's target acknowledged
    /// makes it WORKING, a restart at SUBMITTED is left out, and a
    /// completion whose result fails the task's schemas is a failure.
    fn prepare(self, record: &TaskRecord, mut events: Vec<StreamResponse>) -> Vec<StreamResponse> {
        let mut past_submitted = record.task.status.state != TaskState::Submitted;
        // A handoff's target acknowledged: the task is WORKING (§3.4).
        if self.acked_now && !past_submitted {
            let (task_id, context_id) = (&record.task.id, &record.task.context_id);
            let working = status_update(task_id, context_id, TaskState::Working, None);
            events.insert(0, working);
            past_submitted = true;
        }
        // An agent picking a handed-on task up starts it over at its end;
        // the gateway task is past SUBMITTED already.
        if past_submitted {
            events.retain(|e| e.state() != Some(TaskState::Submitted));
        }
        if !self.returning {
            for (schema, mark) in record.result_schemas() {
                enforce_return_schema(&record.task, schema, mark, &mut events);
            }
        }
        events
    }
}

impl Driver {
    /// `events` prepared against the task as it is now, when it has result
    /// schemas to check them by: with the event the check saw last, so the
    /// write can tell whether the task changed since.
    fn check_results_ahead(
        &self,
        report: Report,
        events: &[StreamResponse],
    ) -> Option<(u64, Vec<StreamResponse>)> {
        let record = self.gateway.ledger.get_shared(&self.task_id).ok()??;
        record.result_schemas().next()?;
        Some((record.last_seq, report.prepare(&record, events.to_vec())))
    }
}

/// Why the ledger would not take a message continuing `task_id`.
pub(super) fn continuation_refused(task_id: &str, err: LedgerError) -> GatewayError {
    match err {
        too_large @ LedgerError::RecordTooLarge { .. } => {
            GatewayError::invalid_field("message", too_large.to_string())
        }
        LedgerError::TooManyEvents { limit, .. } => GatewayError::UnsupportedOperation(format!(
            "task {task_id} has reached its limit of {limit} events and accepts no more messages"
        )),
        other => GatewayError::from(other),
    }
}

/// How often a deadline that passed while a driver was on its task looks
/// whether the driver is done.
const RUNNING_RECHECK: Duration = Duration::from_millis(50);

impl Gateway {
    /// Fails `task_id` with `DEADLINE_EXCEEDED` at `deadline` if it is then
    /// still waiting for input, once no driver is on it.
    pub(super) fn expire_at_deadline(self: Arc<Self>, task_id: String, deadline: DateTime<Utc>) {
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = until(Some(deadline)) => {}
                _ = shutdown.cancelled() => return,
            }
            // A driver still on the task (the one that armed this timer,
            // letting go, or a turn on an answer) is waited for: the task
            // may be left waiting again, past its deadline.
            while self.is_running(&task_id) {
                tokio::select! {
                    () = tokio::time::sleep(RUNNING_RECHECK) => {}
                    _ = shutdown.cancelled() => return,
                }
            }
            let Ok(Some(record)) = self.ledger.get(&task_id) else {
                return;
            };
            if !record.task.status.state.is_interrupted() {
                return;
            }
            // A deadline of a transfer's target, made longer again when its
            // result went back to its source: the task's own one holds.
            let now_due =
                Control::read_from(record.task.metadata.as_ref()).and_then(|c| c.deadline);
            if let Some(later) = now_due.filter(|due| *due > deadline) {
                self.expire_at_deadline(task_id, later);
                return;
            }
            // An agent deregistered since is sent no CancelTask; the task
            // still fails.
            let agent = self.agent(&record.agent);
            expire_task(&self, agent.as_deref(), &task_id).await;
        });
    }

    /// The ackTimeout for `agent`: the gateway's, shortened by the agent's own.
    pub(super) fn ack_timeout(&self, agent: &AgentEntry) -> Duration {
        agent
            .policy
            .ack_timeout
            .map_or(self.settings.ack_timeout, |own| {
                own.min(self.settings.ack_timeout)
            })
    }

    /// What a finished task says about its handoffs: the last one's outcome.
    fn metrics_finished(&self, task_id: &str) {
        let Ok(Some(record)) = self.ledger.get(task_id) else {
            return;
        };
        let [.., before, last] = record.hops.as_slice() else {
            return;
        };
        let succeeded = record.task.status.state == TaskState::Completed;
        self.metrics
            .handoff_finished(&before.agent, &last.agent, succeeded);
    }
}

/// Tells the agent, if still registered, to stop, and fails the task with
/// `DEADLINE_EXCEEDED`; the sources waiting for its result are released.
async fn expire_task(gateway: &Gateway, agent: Option<&AgentEntry>, task_id: &str) {
    let reason = status_part(reasons::DEADLINE_EXCEEDED, json!({}));
    stop_task(gateway, agent, task_id, reason).await;
}

/// Tells the agent, if still registered, to stop, and fails the task with
/// the status part `reason`; the sources waiting for its result are released.
async fn stop_task(gateway: &Gateway, agent: Option<&AgentEntry>, task_id: &str, reason: Part) {
    let record = match gateway.ledger.get_shared(task_id) {
        Ok(Some(record)) if record.task.status.state.is_terminal() => return,
        Ok(record) => record,
        Err(_) => None,
    };
    // FAILED, and CancelTask sent at once (DESIGN.md §3.4, for a deadline).
    // The agent's answer is awaited briefly first, so that an agent that
    // answers has stopped before anyone sees FAILED; one that does not,
    // often why the deadline passed, holds the failure up only that long,
    // not for its request timeout.
    let cancel = async {
        let Some(record) = record else {
            return;
        };
        gateway.release_paused_sources(task_id).await;
        let Some(agent) = agent else {
            return;
        };
        if let Err(err) = agent
            .agent
            .cancel(&record.task, record.upstream.as_ref())
            .await
        {
            tracing::warn!(task_id, %err, "agent did not confirm the cancel of a stopped task");
        }
    };
    tokio::pin!(cancel);
    let answered = tokio::time::timeout(CANCEL_HEAD_START, &mut cancel)
        .await
        .is_ok();
    let fail = settle_task(gateway, task_id, TaskState::Failed, vec![reason]);
    if answered {
        fail.await;
    } else {
        tokio::join!(cancel, fail);
    }
}

/// Why an agent's report was not written.
enum ReportError {
    /// It would have passed one of the task's limits.
    PastLimit(TaskLimit),
    /// Any other failure, as the caller gets it.
    Other(GatewayError),
}

impl From<LedgerError> for ReportError {
    fn from(err: LedgerError) -> Self {
        match err.passed_limit() {
            Some(exceeded) => Self::PastLimit(exceeded),
            None => Self::Other(err.into()),
        }
    }
}

/// How long an abandoned attempt's call is kept to learn what task, if
/// any, the agent created for it.
const ABANDONED_ANSWER_WAIT: Duration = Duration::from_secs(60);

/// How long a deadline's FAILED waits for the agent to answer its CancelTask.
const CANCEL_HEAD_START: Duration = Duration::from_millis(200);

/// Moves a task to `state` (unless it is terminal already) with a status
/// message of `parts`, and closes its current hop.
pub(super) async fn settle_task(
    gateway: &Gateway,
    task_id: &str,
    state: TaskState,
    parts: Vec<Part>,
) {
    let now = Utc::now();
    let result = gateway
        .ledger
        .update(task_id, |record| {
            if record.task.status.state.is_terminal() {
                return Ok::<_, GatewayError>(Change::Unchanged);
            }
            let mut message = Message::agent(parts);
            message.task_id = task_id.to_string();
            message.context_id = record.task.context_id.clone();
            let events = vec![status_update(
                task_id,
                &record.task.context_id,
                state,
                Some(message),
            )];
            note_hop(record, &events, false, now);
            Ok(Change::Made(events))
        })
        .await;
    if let Err(err) = result {
        tracing::error!(task_id, %err, "could not record the task's end");
    }
}

/// The status message of a task its agent's fault ends: the error as text,
/// and its reason code with the agent (and an agent's JSON-RPC error code).
fn agent_failure(agent_id: &str, err: &AgentError) -> Vec<Part> {
    let reason = match err {
        AgentError::Unreachable(_) => reasons::UPSTREAM_UNREACHABLE,
        AgentError::Timeout(_) => reasons::UPSTREAM_TIMEOUT,
        AgentError::NotJson(_) | AgentError::InvalidResponse(_) => reasons::INVALID_AGENT_RESPONSE,
        AgentError::Refused { .. } => reasons::UPSTREAM_ERROR,
        AgentError::Failed(_) | AgentError::InvalidInput(_) => reasons::AGENT_FAILED,
    };
    let mut detail = json!({ "agent": agent_id });
    if let AgentError::Refused { code, .. } = err {
        detail["code"] = json!(code);
    }
    vec![Part::text(err.to_string()), status_part(reason, detail)]
}

/// Notes on the task's current hop what `events` do: its acknowledgement,
/// and its end when they settle or interrupt the task.
pub(super) fn note_hop(
    record: &mut TaskRecord,
    events: &[StreamResponse],
    acknowledged: bool,
    now: DateTime<Utc>,
) {
    let upstream_task_id = record.upstream.as_ref().map(|u| u.task_id.clone());
    let Some(hop) = record.hops.last_mut() else {
        return;
    };
    let first_ack = acknowledged && hop.acked_at.is_none();
    if first_ack {
        hop.acked_at = Some(now);
    }
    if hop.upstream_task_id.is_none() {
        hop.upstream_task_id = upstream_task_id;
    }
    let settled = events
        .iter()
        .rev()
        .find_map(StreamResponse::state)
        .filter(|state| state.is_settled());
    if let Some(state) = settled {
        hop.ended_at = Some(now);
        hop.state = Some(state);
        hop.reason = events.iter().rev().find_map(reason_of);
    }
    // A delivery acknowledged, or given up on (the ladder's end), is not
    // made again, unless the caller answers its escalation. It is kept on its
    // first hop, which a reroute's goes back to.
    let escalated = settled == Some(TaskState::InputRequired)
        && hop.reason.as_deref() == Some(reasons::ESCALATED);
    if first_ack || (settled.is_some() && !escalated) {
        for hop in &mut record.hops {
            hop.undelivered = None;
            hop.escalation_answers.clear();
        }
    }
}

/// Whether the task waits on a handoff the failure ladder escalated to the
/// caller: its last hop, unacknowledged, ended ESCALATED.
fn escalated_delivery(record: &TaskRecord) -> bool {
    record.task.status.state == TaskState::InputRequired
        && record.hops.last().is_some_and(|hop| {
            hop.acked_at.is_none() && hop.reason.as_deref() == Some(reasons::ESCALATED)
        })
}

/// Opens again the delivery of a handoff escalated to the caller, which the
/// caller's answer, about to join the history, lets try again; the hop the
/// delivery began at notes where the first unacknowledged answer is, which
/// with those after it goes after the delivery's message ([`Driver::redelivery`], and a restart's
/// [`Driver::undelivered_handoff`]). Whether there was one.
fn reopen_escalated_delivery(record: &mut TaskRecord) -> bool {
    if !escalated_delivery(record) {
        return false;
    }
    let answer_at = record.task.history.len();
    // An answer to a redelivery's escalation goes after the earlier ones,
    // which the agent never acknowledged either.
    if let Some(origin) = delivery_began_at(&record.hops) {
        record.hops[origin].escalation_answers.push(answer_at);
    }
    if let Some(hop) = record.hops.last_mut() {
        hop.ended_at = None;
        hop.state = None;
        hop.reason = None;
        hop.attempts = 1;
        // The redelivery's ladder begins at this hop (a restart's too).
        if hop.escalation_answers.last() != Some(&answer_at) {
            hop.escalation_answers.push(answer_at);
        }
    }
    true
}

/// The hop a task's current delivery began at: its last that was no
/// reroute (a reroute's delivery goes back to it).
pub(super) fn delivery_began_at(hops: &[HopRecord]) -> Option<usize> {
    hops.iter().rposition(|hop| hop.kind != HopKind::Reroute)
}

/// The reason code in a status event's message, if it has one.
fn reason_of(event: &StreamResponse) -> Option<String> {
    let StreamResponse::StatusUpdate(update) = event else {
        return None;
    };
    let message = update.status.message.as_ref()?;
    let status = find_data(&message.parts, reasons::STATUS_MEDIA_TYPE)?;
    status.get("reason")?.as_str().map(str::to_string)
}

/// The first hop of a task created on its agent's first answer.
fn first_hop(agent: &AgentEntry, kind: HopKind) -> HopRecord {
    HopRecord {
        agent: agent.id.clone(),
        kind,
        started_at: Utc::now(),
        attempts: 1,
        ..HopRecord::default()
    }
}

/// A status update event.
pub(super) fn status_update(
    task_id: &str,
    context_id: &str,
    state: TaskState,
    message: Option<Message>,
) -> StreamResponse {
    StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
        task_id: task_id.to_string(),
        context_id: context_id.to_string(),
        status: TaskStatus::now(state, message),
        metadata: None,
    })
}

/// Sleeps until `deadline`, forever without one.
pub(super) async fn until(deadline: Option<DateTime<Utc>>) {
    match deadline {
        // One passed already is ready at its first poll.
        Some(deadline) => {
            if let Ok(left) = (deadline - Utc::now()).to_std() {
                tokio::time::sleep(left).await;
            }
        }
        None => std::future::pending::<()>().await,
    }
}

pub(super) fn send_first(first_tx: &mut Option<oneshot::Sender<First>>, first: First) {
    if let Some(tx) = first_tx.take() {
        let _ = tx.send(first);
    }
}

/// `events`, counted as the gateway handles them if the execution forwards
/// follow-ups ([`AgentEvents::until_handled`]); with the count's sender.
fn counted(events: AgentEvents) -> (AgentEvents, Option<watch::Sender<u64>>) {
    if !events.has_follow_ups() {
        return (events, None);
    }
    let (handled, counted) = watch::channel(0);
    (events.with_handled(counted), Some(handled))
}

/// The agent's own ids, when the batch reports them.
fn last_bound(batch: &[AgentEvent]) -> Option<UpstreamRef> {
    batch.iter().rev().find_map(|event| match event {
        AgentEvent::Bound(upstream) => Some(upstream.clone()),
        _ => None,
    })
}

/// A transfer (DESIGN.md §3.3): a payload part in a status message, an
/// artifact or a reply of `agent`'s, naming `agent` as its sender. A payload
/// naming someone else is data the agent passes along (an echo, a quote),
/// not a handoff of its own. One naming no sender is the agent's own: no
/// valid payload it could quote lacks one, so it is validated, and refused
/// with the violations, rather than passed along unread.
fn find_transfer(batch: &[AgentEvent], agent: &str) -> Option<FoundTransfer> {
    let (mut said, mut before) = (None, None);
    let mut data = None;
    for event in batch {
        let parts = match event {
            AgentEvent::Status { message, .. } => message.as_ref().map(|m| m.parts.as_slice()),
            AgentEvent::Artifact { artifact, .. } => Some(artifact.parts.as_slice()),
            AgentEvent::Message(message) => Some(message.parts.as_slice()),
            AgentEvent::Bound(_) | AgentEvent::StillIn(_) => None,
        };
        if data.is_none()
            && let Some(found) = parts.and_then(|p| find_data(p, HANDOFF_MEDIA_TYPE))
            && found
                .get("from")
                .and_then(|from| from.as_str())
                .is_none_or(|from| from == agent)
        {
            data = Some(found.clone());
        }
        let state = state_set_by(event);
        if data.is_some() {
            said = state.or(said);
        } else {
            before = state.or(before);
        }
    }
    data.map(|data| FoundTransfer { data, said, before })
}

/// A transfer in a batch of an agent's events.
struct FoundTransfer {
    /// The payload's data.
    data: serde_json::Value,
    /// The state the agent left its own task in with the payload or after
    /// it, if it said.
    said: Option<TaskState>,
    /// The state it last said before the payload: it may say another next.
    before: Option<TaskState>,
}

/// How long a transfer found in an artifact waits for the status its source
/// leaves its own task in, when that did not come with it.
const TRANSFER_STATUS_WAIT: Duration = Duration::from_millis(500);

/// The state `event` leaves the agent's task in, if it says: a message
/// reply completes it.
fn state_set_by(event: &AgentEvent) -> Option<TaskState> {
    match event {
        AgentEvent::Status { state, .. } | AgentEvent::StillIn(state) => Some(*state),
        AgentEvent::Message(_) => Some(TaskState::Completed),
        AgentEvent::Artifact { .. } | AgentEvent::Bound(_) => None,
    }
}

/// The agent's next events into `batch`, up to the first that sets a state:
/// that state. `None` once the agent is done without one.
async fn next_state(
    receiver: &mut mpsc::Receiver<AgentEvent>,
    execution: &mut Execution,
    batch: &mut Vec<AgentEvent>,
) -> Option<TaskState> {
    loop {
        let event = tokio::select! {
            event = receiver.recv() => event?,
            () = execution.progress(), if execution.running() => continue,
        };
        let state = state_set_by(&event);
        batch.push(event);
        if state.is_some() {
            return state;
        }
    }
}

/// Under handoff semantics a message reply acknowledges and completes the
/// task: its parts become an artifact named `response` (DESIGN.md §3.3).
fn reply_as_response(event: AgentEvent) -> Vec<AgentEvent> {
    match event {
        AgentEvent::Message(message) => vec![
            AgentEvent::Artifact {
                artifact: Artifact {
                    artifact_id: uuid::Uuid::new_v4().to_string(),
                    name: "response".into(),
                    parts: message.parts,
                    ..Artifact::default()
                },
                append: false,
                last_chunk: true,
            },
            AgentEvent::Status {
                state: TaskState::Completed,
                message: None,
            },
        ],
        other => vec![other],
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
        AgentEvent::Bound(_) | AgentEvent::StillIn(_) => return None,
        AgentEvent::Status { state, message } => {
            status_update(task_id, context_id, state, message.map(fill))
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
        AgentEvent::Message(message) => status_update(
            task_id,
            context_id,
            TaskState::Completed,
            Some(fill(message)),
        ),
    };
    Some(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transfer takes the state its source said with the payload or
    /// after it; one said before is only the fallback, if none comes.
    #[test]
    fn a_transfer_takes_the_state_said_with_or_after_its_payload() {
        let status = |state| AgentEvent::Status {
            state,
            message: None,
        };
        let payload = AgentEvent::Artifact {
            artifact: Artifact {
                artifact_id: "h1".into(),
                parts: vec![Part {
                    media_type: HANDOFF_MEDIA_TYPE.into(),
                    ..Part::data(serde_json::json!({"from": "source", "to": "echo"}))
                }],
                ..Artifact::default()
            },
            append: false,
            last_chunk: true,
        };
        let found = |batch: &[AgentEvent]| {
            let found = find_transfer(batch, "source").expect("a transfer");
            (found.said, found.before)
        };
        let (working, paused) = (TaskState::Working, TaskState::AuthRequired);
        assert_eq!(
            found(&[status(paused), payload.clone()]),
            (None, Some(paused))
        );
        assert_eq!(
            found(&[
                status(working),
                payload.clone(),
                AgentEvent::StillIn(paused)
            ]),
            (Some(paused), Some(working))
        );
        assert_eq!(
            found(&[payload.clone(), status(paused)]),
            (Some(paused), None)
        );
        assert!(find_transfer(&[payload], "another").is_none(), "a quote");
    }

    #[test]
    fn a_delivery_is_kept_until_acknowledged_or_given_up() {
        use crate::store::Undelivered;
        let hop = |kind| HopRecord {
            agent: "worker".into(),
            kind,
            undelivered: Some(Undelivered::default()),
            ..HopRecord::default()
        };
        let delivering = TaskRecord {
            hops: vec![hop(HopKind::Transfer), hop(HopKind::Reroute)],
            ..TaskRecord::default()
        };
        let kept = |record: &TaskRecord| record.hops.iter().any(|h| h.undelivered.is_some());
        // A ladder step's event in the task's state acknowledges nothing.
        let mut record = delivering.clone();
        let working = status_update("t", "c", TaskState::Working, None);
        note_hop(&mut record, &[working], false, Utc::now());
        assert!(kept(&record));
        // The target's first answer.
        note_hop(&mut record, &[], true, Utc::now());
        assert!(!kept(&record));
        // The ladder's end, escalated or failed.
        for state in [TaskState::InputRequired, TaskState::Failed] {
            let mut record = delivering.clone();
            let ended = status_update("t", "c", state, None);
            note_hop(&mut record, &[ended], false, Utc::now());
            assert!(!kept(&record), "{state:?}");
        }
    }

    #[test]
    fn an_abandoned_task_is_an_orphan_once_it_can_no_longer_be_taken_up() {
        let bound = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(agent, task)| (agent.to_string(), task.to_string()))
                .collect()
        };
        // Abandoned after one adoption (an earlier turn's), the retry pending.
        let pending = Adoptions {
            bound: bound(&[("triage", "t0")]),
            ended: false,
            ..Adoptions::default()
        };
        assert_eq!(pending.orphans(1, "slow", "x"), None);
        // The retry was answered with the same task (the agent deduplicates
        // by messageId): taken up, never canceled, even once the driver ends.
        let same = Adoptions {
            bound: bound(&[("triage", "t0"), ("slow", "x")]),
            ended: true,
            ..Adoptions::default()
        };
        assert_eq!(same.orphans(1, "slow", "x"), Some(false));
        // Another task was taken up, by this agent or by a reroute's.
        for agent in ["slow", "other"] {
            let other = Adoptions {
                bound: bound(&[("triage", "t0"), (agent, "y")]),
                ended: false,
                ..Adoptions::default()
            };
            assert_eq!(other.orphans(1, "slow", "x"), Some(true));
        }
        // The same task id at another agent is not this one.
        let elsewhere = Adoptions {
            bound: bound(&[("other", "x")]),
            ended: false,
            ..Adoptions::default()
        };
        assert_eq!(elsewhere.orphans(0, "slow", "x"), Some(true));
        // The ladder ended with nothing taken up.
        let ended = Adoptions {
            bound: bound(&[("triage", "t0")]),
            ended: true,
            ..Adoptions::default()
        };
        assert_eq!(ended.orphans(1, "slow", "x"), Some(true));
    }

    #[tokio::test]
    async fn an_execution_ends_with_its_outcome_a_panic_or_nothing_when_aborted() {
        let done = Execution::new(
            async { Err(AgentError::Timeout("slow".into())) },
            CancellationToken::new(),
            false,
        );
        assert!(matches!(
            done.finish().await,
            Some(Err(AgentError::Timeout(_)))
        ));

        let panicking = Execution::new(
            async {
                panic!("agent bug");
                #[allow(unreachable_code)]
                Ok(())
            },
            CancellationToken::new(),
            false,
        );
        assert!(matches!(
            panicking.finish().await,
            Some(Err(AgentError::Failed(why))) if why.contains("panicked")
        ));

        let mut endless = Execution::new(std::future::pending(), CancellationToken::new(), false);
        assert!(endless.running());
        endless.abort();
        assert!(!endless.running());
        assert!(endless.finish().await.is_none());
    }
}
