//! `RemoteAgent`: an A2A agent elsewhere, behind the same [`Agent`] trait as
//! the built-in ones.
//!
//! Each execution forwards the caller's message (the upstream's own task and
//! context ids on a continuation, the gateway's context id on a new task),
//! then follows the upstream task until it is terminal or INPUT_REQUIRED: over
//! the stream when the card declares `capabilities.streaming`, else by
//! `returnImmediately` and GetTask polls with exponential backoff. What it
//! learns becomes [`AgentEvent`]s: the upstream ids once (`Bound`), then only
//! what changed since the last report, so polling adds no duplicate events.
//! A message a caller adds meanwhile ([`FollowUp`]) is forwarded by the
//! execution that follows, with SendMessage and `returnImmediately`: a
//! second stream of the same task would report its artifact chunks twice.

use super::client::{UpstreamClient, UpstreamStream};
use super::{UpstreamConfigError, UpstreamSettings};
use crate::agents::{
    Agent, AgentError, AgentEvent, AgentEvents, AgentRequest, FollowUp, FollowUpReceiver,
    UpstreamRef,
};
use crate::handoff::control::Control;
use crate::handoff::payload::{HANDOFF_MEDIA_TYPE, find_data};
use crate::netguard::OutboundPolicy;
use crate::protocol::{
    AgentCard, Artifact, CancelTaskRequest, GetTaskRequest, Message, ProtoEnum as _,
    SendMessageConfiguration, SendMessageRequest, SendMessageResponse, StreamResponse,
    SubscribeToTaskRequest, Task, TaskState, TaskStatus,
};
use async_trait::async_trait;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// An A2A 1.0 agent reached over JSON-RPC.
#[derive(Debug)]
pub struct RemoteAgent {
    card: AgentCard,
    client: UpstreamClient,
}

impl RemoteAgent {
    /// The agent described by `card`, called through `client`.
    pub fn new(card: AgentCard, client: UpstreamClient) -> Self {
        Self { card, client }
    }

    /// The agent described by `card`, called at its first `JSONRPC`
    /// interface under the outbound `policy`.
    pub fn from_card(
        card: AgentCard,
        policy: &OutboundPolicy,
        settings: UpstreamSettings,
    ) -> Result<Self, UpstreamConfigError> {
        let client = UpstreamClient::for_card(&card, policy, settings)?;
        Ok(Self::new(card, client))
    }

    /// The client calls go through.
    pub fn client(&self) -> &UpstreamClient {
        &self.client
    }

    /// Whether the card promises SendStreamingMessage and SubscribeToTask.
    fn streams(&self) -> bool {
        self.card.capabilities.streaming == Some(true)
    }

    /// Forwards the message and follows the task it creates or continues.
    async fn run(&self, mut request: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        let mut follower = Follower::new(events);
        if let Some(task) = &request.task {
            follower.knows(task);
            // The gateway moved the task to WORKING when the answer arrived.
            follower.status = Some((TaskState::Working, None));
        }
        let streaming = self.streams();
        let send = SendMessageRequest {
            message: Some(outgoing(
                std::mem::take(&mut request.message),
                request.upstream.as_ref(),
                &request.context_id,
            )),
            configuration: Some(SendMessageConfiguration {
                accepted_output_modes: request.accepted_output_modes.clone(),
                // Learn at once that the agent took the work (DESIGN.md §3).
                return_immediately: !streaming,
                ..SendMessageConfiguration::default()
            }),
            ..SendMessageRequest::default()
        };
        tracing::debug!(task_id = %request.task_id, agent = %self.card.name, streaming, upstream = ?request.upstream, "forwarding message");
        if streaming {
            let stream = self.client.send_streaming_message(send).await?;
            if self.follow_stream(&mut follower, stream).await? == Flow::Done {
                return Ok(());
            }
        } else {
            let first = match self.client.send_message(send).await? {
                SendMessageResponse::Task(task) => StreamResponse::Task(task),
                SendMessageResponse::Message(message) => StreamResponse::Message(message),
            };
            if follower.on_event(first).await? == Flow::Done {
                return Ok(());
            }
        }
        self.poll(&mut follower, self.client.settings().poll_initial)
            .await
    }

    /// Follows a stream until the task settles (`Done`) or the stream ends or
    /// breaks without that (`Continue`: poll the rest).
    async fn follow_stream(
        &self,
        follower: &mut Follower,
        mut stream: UpstreamStream,
    ) -> Result<Flow, AgentError> {
        loop {
            let next = tokio::select! {
                next = stream.next() => next,
                Some(follow_up) = next_follow_up(&mut follower.follow_ups), if follower.bound.is_some() => {
                    if self.forward(follower, follow_up).await? == Flow::Done {
                        return Ok(Flow::Done);
                    }
                    continue;
                }
            };
            match next {
                // A question the stream brings after a follow-up went may be
                // older than the follow-up, which the agent may have taken as
                // the answer: the polls ask the agent.
                Some(Ok(event))
                    if follower.forwarded && event.state() == Some(TaskState::InputRequired) =>
                {
                    return Ok(Flow::Continue);
                }
                Some(Ok(event)) => {
                    if follower.on_event(event).await? == Flow::Done {
                        return Ok(Flow::Done);
                    }
                }
                // The agent holds the task; a lost connection loses only the feed.
                Some(Err(err @ (AgentError::Unreachable(_) | AgentError::Timeout(_))))
                    if follower.bound.is_some() =>
                {
                    tracing::warn!(agent = %self.card.name, %err, "agent stream broke; polling instead");
                    return Ok(Flow::Continue);
                }
                Some(Err(err)) => return Err(err),
                None if follower.bound.is_none() => {
                    return Err(AgentError::InvalidResponse(format!(
                        "{}: the stream ended before the agent reported a task or a message",
                        self.client.url()
                    )));
                }
                None => {
                    tracing::debug!(agent = %self.card.name, "agent stream ended early; polling");
                    return Ok(Flow::Continue);
                }
            }
        }
    }

    /// Polls GetTask, the first time after `first_delay`, until the task
    /// settles: quickly while it changes, then backing off to `poll_max`.
    /// No connection or no answer is retried for up to `follow_outage` in a
    /// row: the task lives on upstream, and the gateway's deadline bounds
    /// the wait anyway.
    async fn poll(&self, follower: &mut Follower, first_delay: Duration) -> Result<(), AgentError> {
        let Some(task_id) = follower.bound.as_ref().map(|b| b.task_id.clone()) else {
            return Err(AgentError::InvalidResponse(
                "the agent reported no task to follow".into(),
            ));
        };
        let settings = self.client.settings();
        let mut delay = first_delay;
        let mut outage_since: Option<Instant> = None;
        loop {
            let sleep = tokio::time::sleep(delay);
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    () = &mut sleep => break,
                    Some(follow_up) = next_follow_up(&mut follower.follow_ups) => {
                        let flow = if self.streams() {
                            self.forward_streaming(follower, follow_up).await?
                        } else {
                            self.forward(follower, follow_up).await?
                        };
                        if flow == Flow::Done {
                            return Ok(());
                        }
                        // What the agent makes of it, soon.
                        delay = settings.poll_initial;
                        sleep.as_mut().reset(tokio::time::Instant::now() + delay);
                    }
                }
            }
            // A snapshot asked for after a follow-up is the agent's own word.
            follower.forwarded = false;
            let reported = follower.reported;
            let request = GetTaskRequest {
                id: task_id.clone(),
                // The status and artifacts are what is followed; not the history.
                history_length: Some(0),
                ..GetTaskRequest::default()
            };
            match self.client.get_task(request).await {
                Ok(task) => {
                    if outage_since.take().is_some() {
                        tracing::info!(agent = %self.card.name, upstream_task = %task_id, "agent answers again");
                    }
                    if follower.on_task(task).await? == Flow::Done {
                        return Ok(());
                    }
                    delay = if follower.reported != reported {
                        settings.poll_initial
                    } else {
                        backoff(delay, poll_cap(follower.state(), settings.poll_max))
                    };
                }
                Err(err @ (AgentError::Unreachable(_) | AgentError::Timeout(_)))
                    if outage_since.get_or_insert_with(Instant::now).elapsed()
                        < settings.follow_outage =>
                {
                    tracing::warn!(agent = %self.card.name, upstream_task = %task_id, %err, "poll failed; retrying");
                    delay = backoff(delay, settings.poll_max);
                }
                Err(err) => return Err(err),
            }
        }
    }
}

impl RemoteAgent {
    /// Sends the agent a follow-up to the task being followed and tells its
    /// sender whether the agent took it. What the agent makes of it comes
    /// with the task's events; a message it answers with is one of them.
    async fn forward(
        &self,
        follower: &mut Follower,
        follow_up: Box<FollowUp>,
    ) -> Result<Flow, AgentError> {
        let (send, asked, taken) = follow_up_request(follow_up, follower.bound.as_ref(), true);
        follower.events.until_handled(follower.reported).await;
        match self.client.send_message(send).await {
            Ok(answer) => {
                follower.forwarded = true;
                follower.answered(asked.as_ref());
                taken.took().await;
                match answer {
                    SendMessageResponse::Message(message) => {
                        follower.on_event(StreamResponse::Message(message)).await
                    }
                    SendMessageResponse::Task(_) => Ok(Flow::Continue),
                }
            }
            // Refused, the follow-up is its sender's error; the task goes on.
            Err(err) => {
                taken.refused(err);
                Ok(Flow::Continue)
            }
        }
    }

    /// Sends a follow-up over SendStreamingMessage and follows the stream it
    /// opens: used once the task's stream is gone (the polls follow it), so
    /// this one is again the task's only feed.
    async fn forward_streaming(
        &self,
        follower: &mut Follower,
        follow_up: Box<FollowUp>,
    ) -> Result<Flow, AgentError> {
        let (send, asked, taken) = follow_up_request(follow_up, follower.bound.as_ref(), false);
        follower.events.until_handled(follower.reported).await;
        let mut stream = match self.client.send_streaming_message(send).await {
            Ok(stream) => stream,
            Err(err) => {
                taken.refused(err);
                return Ok(Flow::Continue);
            }
        };
        // The agent took the message once its stream says anything but an
        // error: a refusal may come as the stream's first event too.
        let first = match stream.next().await {
            Some(Ok(first)) => first,
            Some(Err(err)) => {
                taken.refused(err);
                return Ok(Flow::Continue);
            }
            None => {
                let ended = "the stream ended before the agent answered";
                taken.refused(AgentError::InvalidResponse(ended.into()));
                return Ok(Flow::Continue);
            }
        };
        follower.answered(asked.as_ref());
        taken.took().await;
        // Its events all come after the agent took the message.
        follower.forwarded = false;
        if follower.on_event(first).await? == Flow::Done {
            return Ok(Flow::Done);
        }
        self.follow_stream(follower, stream).await
    }
}

/// The send that forwards `follow_up` to the agent's task `bound`, the
/// status it answers, and where its sender waits for the agent's answer.
fn follow_up_request(
    follow_up: Box<FollowUp>,
    bound: Option<&UpstreamRef>,
    return_immediately: bool,
) -> (SendMessageRequest, Option<TaskStatus>, Taken) {
    let FollowUp {
        message,
        accepted_output_modes,
        answers,
        taken,
        recorded,
    } = *follow_up;
    let send = SendMessageRequest {
        message: Some(outgoing(message, bound, "")),
        configuration: Some(SendMessageConfiguration {
            accepted_output_modes,
            return_immediately,
            ..SendMessageConfiguration::default()
        }),
        ..SendMessageRequest::default()
    };
    (send, answers, Taken { taken, recorded })
}

/// Where a follow-up's sender learns whether the agent took it, and then
/// when its task recorded it.
struct Taken {
    taken: oneshot::Sender<Result<(), AgentError>>,
    recorded: oneshot::Receiver<()>,
}

impl Taken {
    /// The agent refused the message, or never answered.
    fn refused(self, err: AgentError) {
        let _ = self.taken.send(Err(err));
    }

    /// The agent took the message: once the task recorded it, what the
    /// agent made of it may be reported.
    async fn took(self) {
        if self.taken.send(Ok(())).is_ok() {
            let _ = self.recorded.await;
        }
    }
}

/// The next follow-up to forward; never, once no sender is left.
async fn next_follow_up(follow_ups: &mut Option<FollowUpReceiver>) -> Option<Box<FollowUp>> {
    match follow_ups {
        Some(receiver) => match receiver.recv().await {
            Some(follow_up) => Some(follow_up),
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// How far polls of a task in `state` back off. A task waiting for a
/// credential waits for a person, mostly: its polls back off further.
fn poll_cap(state: Option<TaskState>, poll_max: Duration) -> Duration {
    if state == Some(TaskState::AuthRequired) {
        poll_max * AUTH_POLL_FACTOR
    } else {
        poll_max
    }
}

/// How many times `poll_max` apart an AUTH_REQUIRED task is polled at most.
const AUTH_POLL_FACTOR: u32 = 10;

fn backoff(delay: Duration, max: Duration) -> Duration {
    (delay * 2).clamp(Duration::from_millis(1), max.max(Duration::from_millis(1)))
}

/// A request's message as the agent should see it: with the agent's own
/// task ids (`upstream`), or the gateway's `context_id` for a new task.
fn outgoing(mut message: Message, upstream: Option<&UpstreamRef>, context_id: &str) -> Message {
    // The gateway task the message is for, until the agent's ids replace it.
    Control::name_parent(&mut message.metadata, &message.task_id);
    match upstream {
        Some(upstream) => {
            message.task_id = upstream.task_id.clone();
            message.context_id = upstream.context_id.clone();
        }
        None => {
            message.task_id.clear();
            message.context_id = context_id.to_string();
        }
    }
    // They name gateway tasks, which the agent does not know.
    message.reference_task_ids.clear();
    message
}

#[async_trait]
impl Agent for RemoteAgent {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    fn creates_remote_tasks(&self) -> bool {
        true
    }

    fn takes_follow_ups(&self) -> bool {
        true
    }

    async fn execute(&self, request: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        let cancel = request.cancel.clone();
        // Dropping the work drops its HTTP call or stream at once. The
        // upstream task is not canceled here: a gateway cancel has already
        // sent CancelTask (`cancel` below), and a shutdown must leave the
        // task running for `recover`.
        tokio::select! {
            biased;
            _ = cancel.cancelled() => Ok(()),
            result = self.run(request, events) => result,
        }
    }

    async fn recover(
        &self,
        task: &Task,
        upstream: Option<&UpstreamRef>,
        events: AgentEvents,
        cancel: CancellationToken,
    ) -> Result<(), AgentError> {
        // As in `execute`: stop following at a cancel or shutdown, and leave
        // the upstream task to the next `recover`.
        tokio::select! {
            biased;
            _ = cancel.cancelled() => Ok(()),
            result = self.resume(task, upstream, events) => result,
        }
    }

    async fn cancel(&self, task: &Task, upstream: Option<&UpstreamRef>) -> Result<(), AgentError> {
        self.forward_cancel(task, upstream).await
    }
}

impl RemoteAgent {
    /// Picks a task up from the agent after a gateway restart.
    async fn resume(
        &self,
        task: &Task,
        upstream: Option<&UpstreamRef>,
        events: AgentEvents,
    ) -> Result<(), AgentError> {
        let Some(upstream) = upstream else {
            return Err(AgentError::Failed(
                "the gateway restarted before the agent acknowledged this task; there is no \
                 upstream task to resume"
                    .into(),
            ));
        };
        tracing::info!(task_id = %task.id, agent = %self.card.name, upstream_task = %upstream.task_id, "resuming a task from its agent");
        let mut follower = Follower::new(events);
        follower.knows(task);
        follower.bound = Some(upstream.clone());
        if self.streams() {
            let request = SubscribeToTaskRequest {
                id: upstream.task_id.clone(),
                ..SubscribeToTaskRequest::default()
            };
            match self.client.subscribe_to_task(request).await {
                Ok(stream) => {
                    if self.follow_stream(&mut follower, stream).await? == Flow::Done {
                        return Ok(());
                    }
                }
                // The task settled while the gateway was down (-32004), the
                // agent forgot it (-32001), or it cannot be reached yet: the
                // polls tell which.
                Err(err) => {
                    tracing::warn!(task_id = %task.id, %err, "cannot resubscribe to the agent's task; polling");
                }
            }
        }
        // At once: a restart may have missed the task's end.
        self.poll(&mut follower, Duration::ZERO).await
    }

    async fn forward_cancel(
        &self,
        task: &Task,
        upstream: Option<&UpstreamRef>,
    ) -> Result<(), AgentError> {
        // A task the agent never acknowledged has nothing to cancel there.
        let Some(upstream) = upstream else {
            return Ok(());
        };
        let answer = self
            .client
            .cancel_task(CancelTaskRequest {
                id: upstream.task_id.clone(),
                ..CancelTaskRequest::default()
            })
            .await?;
        tracing::info!(task_id = %task.id, upstream_task = %upstream.task_id, state = answer.status.state.proto_name(), "agent answered the cancel");
        Ok(())
    }
}

/// Whether following a task goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flow {
    /// Not settled yet.
    Continue,
    /// Terminal, interrupted, answered with a message, or the gateway stopped
    /// listening.
    Done,
}

/// A status as compared between reports: the state and its message's id.
type StatusKey = (TaskState, Option<String>);

/// What one execution has reported, so only changes are reported again.
struct Follower {
    events: AgentEvents,
    bound: Option<UpstreamRef>,
    status: Option<StatusKey>,
    /// Each artifact as the gateway holds it after the reports.
    artifacts: HashMap<String, Artifact>,
    /// How many events were reported, to tell a poll that changed something.
    reported: u64,
    /// Messages added to the task meanwhile, to forward.
    follow_ups: Option<FollowUpReceiver>,
    /// A follow-up went since the agent's last snapshot was asked for.
    forwarded: bool,
    /// A handoff payload went in an artifact since the last status: the
    /// gateway waits for the state the agent leaves its task in (a
    /// transfer's), so the next status is reported even unchanged.
    status_owed: bool,
}

impl Follower {
    fn new(mut events: AgentEvents) -> Self {
        Self {
            follow_ups: events.take_follow_ups(),
            forwarded: false,
            status_owed: false,
            events,
            bound: None,
            status: None,
            artifacts: HashMap::new(),
            reported: 0,
        }
    }

    /// Takes what the gateway already holds of `task` as reported.
    fn knows(&mut self, task: &Task) {
        self.status = Some(status_key(&task.status));
        self.artifacts = task
            .artifacts
            .iter()
            .map(|a| (a.artifact_id.clone(), a.clone()))
            .collect();
    }

    /// The agent took a follow-up answering the AUTH_REQUIRED status
    /// `asked`: if that is what this execution last reported, the gateway
    /// makes the task WORKING (it decides alike), so the agent asking again
    /// is a change to report.
    fn answered(&mut self, asked: Option<&TaskStatus>) {
        if let Some(asked) = asked
            && self.status.as_ref() == Some(&status_key(asked))
        {
            self.status = Some((TaskState::Working, None));
        }
    }

    /// The state last reported, or known.
    fn state(&self) -> Option<TaskState> {
        self.status.as_ref().map(|(state, _)| *state)
    }

    /// Reports one event; `Done` when the gateway no longer listens.
    async fn emit(&mut self, event: AgentEvent) -> Flow {
        self.reported += 1;
        if let AgentEvent::Artifact { artifact, .. } = &event
            && find_data(&artifact.parts, HANDOFF_MEDIA_TYPE).is_some()
        {
            self.status_owed = true;
        }
        if self.events.send(event).await {
            Flow::Continue
        } else {
            Flow::Done
        }
    }

    async fn bind(&mut self, task_id: &str, context_id: &str) -> Result<Flow, AgentError> {
        match &self.bound {
            Some(bound) if bound.task_id == task_id => Ok(Flow::Continue),
            Some(bound) => Err(AgentError::InvalidResponse(format!(
                "the agent reported task {task_id:?} while working on {:?}",
                bound.task_id
            ))),
            None => {
                let upstream = UpstreamRef {
                    task_id: task_id.to_string(),
                    context_id: context_id.to_string(),
                };
                self.bound = Some(upstream.clone());
                Ok(self.emit(AgentEvent::Bound(upstream)).await)
            }
        }
    }

    async fn on_event(&mut self, event: StreamResponse) -> Result<Flow, AgentError> {
        match event {
            StreamResponse::Task(task) => self.on_task(task).await,
            StreamResponse::Message(message) if self.bound.is_none() => {
                // A direct reply: no task exists upstream, nor will at the gateway.
                self.emit(AgentEvent::Message(message)).await;
                Ok(Flow::Done)
            }
            StreamResponse::Message(message) => {
                // A message about the task: recorded with the state it is in.
                let state = match &self.status {
                    Some((state, _)) if *state != TaskState::Submitted => *state,
                    _ => TaskState::Working,
                };
                self.status = Some((state, Some(message.message_id.clone())));
                let message = Some(message);
                Ok(self.emit(AgentEvent::Status { state, message }).await)
            }
            StreamResponse::StatusUpdate(update) => {
                if self.bind(&update.task_id, &update.context_id).await? == Flow::Done {
                    return Ok(Flow::Done);
                }
                self.on_status(update.status).await
            }
            StreamResponse::ArtifactUpdate(update) => {
                if self.bind(&update.task_id, &update.context_id).await? == Flow::Done {
                    return Ok(Flow::Done);
                }
                // Kept as the ledger merges it, so a later snapshot compares equal.
                let id = update.artifact.artifact_id.clone();
                match self.artifacts.get_mut(&id) {
                    Some(held) if update.append => {
                        held.parts.extend(update.artifact.parts.iter().cloned());
                    }
                    _ => {
                        self.artifacts.insert(id, update.artifact.clone());
                    }
                }
                Ok(self
                    .emit(AgentEvent::Artifact {
                        artifact: update.artifact,
                        append: update.append,
                        last_chunk: update.last_chunk,
                    })
                    .await)
            }
        }
    }

    /// A snapshot: the ids, then new or changed artifacts, then the status
    /// (artifacts first: a terminal task takes no more).
    async fn on_task(&mut self, task: Task) -> Result<Flow, AgentError> {
        if self.bind(&task.id, &task.context_id).await? == Flow::Done {
            return Ok(Flow::Done);
        }
        // A snapshot that ends the following is the last this follower
        // compares with (a blocking call's only answer): its artifacts need
        // not be kept.
        let last = ends_following(task.status.state);
        for artifact in task.artifacts {
            if self.artifacts.get(&artifact.artifact_id) == Some(&artifact) {
                continue;
            }
            if !last {
                self.artifacts
                    .insert(artifact.artifact_id.clone(), artifact.clone());
            }
            let event = AgentEvent::Artifact {
                artifact,
                append: false,
                last_chunk: true,
            };
            if self.emit(event).await == Flow::Done {
                return Ok(Flow::Done);
            }
        }
        self.on_status(task.status).await
    }

    async fn on_status(&mut self, status: TaskStatus) -> Result<Flow, AgentError> {
        let key = status_key(&status);
        let settled = ends_following(status.state);
        let owed = std::mem::take(&mut self.status_owed);
        let changed = self.status.as_ref() != Some(&key);
        if changed {
            self.status = Some(key);
        }
        // Never SUBMITTED: a new gateway task starts there anyway, and a
        // continued one, already WORKING, may not go back.
        let event = if changed && status.state != TaskState::Submitted {
            Some(AgentEvent::Status {
                state: status.state,
                message: status.message,
            })
        } else if owed {
            let state = match status.state {
                TaskState::Submitted => TaskState::Working,
                state => state,
            };
            Some(AgentEvent::StillIn(state))
        } else {
            None
        };
        if let Some(event) = event
            && self.emit(event).await == Flow::Done
        {
            return Ok(Flow::Done);
        }
        Ok(if settled { Flow::Done } else { Flow::Continue })
    }
}

/// Whether the agent's task in `state` is followed no further: terminal, or
/// waiting for input that only a message brings. At AUTH_REQUIRED the agent
/// may go on once it gets a credential out of band (A2A §7.6.1), so it is
/// followed on, until the task's deadline at the latest.
fn ends_following(state: TaskState) -> bool {
    state.is_terminal() || state == TaskState::InputRequired
}

fn status_key(status: &TaskStatus) -> StatusKey {
    (
        status.state,
        status.message.as_ref().map(|m| m.message_id.clone()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Part, TaskArtifactUpdateEvent, TaskStatusUpdateEvent};

    fn task(state: TaskState, artifacts: Vec<Artifact>) -> Task {
        Task {
            id: "up-1".into(),
            context_id: "ctx".into(),
            status: TaskStatus::now(state, None),
            artifacts,
            ..Task::default()
        }
    }

    fn artifact(id: &str, text: &str) -> Artifact {
        Artifact {
            artifact_id: id.into(),
            parts: vec![Part::text(text)],
            ..Artifact::default()
        }
    }

    fn drain(receiver: &mut tokio::sync::mpsc::Receiver<AgentEvent>) -> Vec<AgentEvent> {
        let mut events = Vec::new();
        while let Ok(event) = receiver.try_recv() {
            events.push(event);
        }
        events
    }

    /// A payload in an artifact is followed by the status even unchanged:
    /// the gateway waits for the state the agent leaves its task in.
    #[tokio::test]
    async fn a_handoff_payload_is_followed_by_the_status_it_owes() {
        let (events, mut receiver) = AgentEvents::channel(64);
        let mut follower = Follower::new(events);
        follower
            .on_task(task(TaskState::Working, vec![]))
            .await
            .unwrap();
        drain(&mut receiver);
        let mut payload = artifact("h1", "x");
        payload.parts = vec![Part {
            media_type: HANDOFF_MEDIA_TYPE.into(),
            ..Part::data(serde_json::json!({"to": "echo"}))
        }];
        for reported in [
            StreamResponse::Task(task(TaskState::Working, vec![payload.clone()])),
            StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
                task_id: "up-1".into(),
                context_id: "ctx".into(),
                artifact: payload.clone(),
                ..Default::default()
            }),
        ] {
            follower.on_event(reported).await.unwrap();
            let status = TaskStatusUpdateEvent {
                task_id: "up-1".into(),
                context_id: "ctx".into(),
                status: TaskStatus {
                    state: TaskState::Working,
                    ..Default::default()
                },
                ..Default::default()
            };
            follower
                .on_event(StreamResponse::StatusUpdate(status))
                .await
                .unwrap();
            let seen = drain(&mut receiver);
            assert!(matches!(seen[0], AgentEvent::Artifact { .. }), "{seen:?}");
            assert_eq!(
                seen[1..],
                [AgentEvent::StillIn(TaskState::Working)],
                "owed once, and recorded nowhere"
            );
        }
    }

    #[tokio::test]
    async fn polls_report_only_changes() {
        let (events, mut receiver) = AgentEvents::channel(64);
        let mut follower = Follower::new(events);
        let flow = follower
            .on_task(task(TaskState::Submitted, vec![]))
            .await
            .unwrap();
        assert_eq!(flow, Flow::Continue);
        assert_eq!(
            drain(&mut receiver),
            [AgentEvent::Bound(UpstreamRef {
                task_id: "up-1".into(),
                context_id: "ctx".into()
            })]
        );

        follower
            .on_task(task(TaskState::Working, vec![artifact("a", "x")]))
            .await
            .unwrap();
        let seen = drain(&mut receiver);
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(matches!(seen[0], AgentEvent::Artifact { .. }));
        assert!(matches!(
            seen[1],
            AgentEvent::Status {
                state: TaskState::Working,
                ..
            }
        ));

        // The same snapshot again: nothing new.
        follower
            .on_task(task(TaskState::Working, vec![artifact("a", "x")]))
            .await
            .unwrap();
        assert!(drain(&mut receiver).is_empty());

        let flow = follower
            .on_task(task(
                TaskState::Completed,
                vec![artifact("a", "x"), artifact("b", "y")],
            ))
            .await
            .unwrap();
        assert_eq!(flow, Flow::Done);
        let seen = drain(&mut receiver);
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(
            matches!(&seen[0], AgentEvent::Artifact { artifact, .. } if artifact.artifact_id == "b")
        );
        assert!(matches!(
            seen[1],
            AgentEvent::Status {
                state: TaskState::Completed,
                ..
            }
        ));
    }

    #[tokio::test]
    async fn streamed_chunks_match_later_snapshots() {
        let (events, mut receiver) = AgentEvents::channel(64);
        let mut follower = Follower::new(events);
        for (text, append) in [("a", false), ("b", true)] {
            let update = TaskArtifactUpdateEvent {
                task_id: "up-1".into(),
                context_id: "ctx".into(),
                artifact: artifact("x", text),
                append,
                last_chunk: append,
                metadata: None,
            };
            follower
                .on_event(StreamResponse::ArtifactUpdate(update))
                .await
                .unwrap();
        }
        assert_eq!(drain(&mut receiver).len(), 3, "bound and two chunks");
        let mut merged = artifact("x", "a");
        merged.parts.push(Part::text("b"));
        follower
            .on_task(task(TaskState::Working, vec![merged]))
            .await
            .unwrap();
        let seen = drain(&mut receiver);
        assert!(
            seen.iter()
                .all(|e| !matches!(e, AgentEvent::Artifact { .. })),
            "{seen:?}"
        );

        // Another task id in the same execution is not a valid answer.
        let stray = StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: "up-2".into(),
            status: TaskStatus::now(TaskState::Completed, None),
            ..TaskStatusUpdateEvent::default()
        });
        assert!(matches!(
            follower.on_event(stray).await,
            Err(AgentError::InvalidResponse(_))
        ));
    }

    #[test]
    fn a_task_waiting_for_a_credential_is_polled_less_often() {
        let max = Duration::from_secs(2);
        assert_eq!(poll_cap(Some(TaskState::Working), max), max);
        assert_eq!(poll_cap(None, max), max);
        assert_eq!(poll_cap(Some(TaskState::AuthRequired), max), max * 10);
    }

    #[test]
    fn continuations_carry_the_upstream_ids() {
        let request = AgentRequest {
            task_id: "gw-task".into(),
            context_id: "gw-ctx".into(),
            message: Message {
                message_id: "m1".into(),
                task_id: "gw-task".into(),
                context_id: "gw-ctx".into(),
                reference_task_ids: vec!["gw-other".into()],
                parts: vec![Part::text("hi")],
                ..Message::default()
            },
            task: None,
            upstream: Some(UpstreamRef {
                task_id: "up-task".into(),
                context_id: "up-ctx".into(),
            }),
            streaming: false,
            accepted_output_modes: Vec::new(),
            cancel: Default::default(),
        };
        let message = outgoing(
            request.message.clone(),
            request.upstream.as_ref(),
            &request.context_id,
        );
        assert_eq!(
            (
                message.task_id.as_str(),
                message.context_id.as_str(),
                message.message_id.as_str()
            ),
            ("up-task", "up-ctx", "m1")
        );
        assert!(message.reference_task_ids.is_empty());
        let fresh = outgoing(request.message.clone(), None, &request.context_id);
        assert_eq!(
            (fresh.task_id.as_str(), fresh.context_id.as_str()),
            ("", "gw-ctx")
        );
    }
}
