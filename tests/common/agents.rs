//! Agents for tests: one that waits to be released, ones that fail, one
//! that asks for input and then works until stopped, one
//! that never answers a cancel, one that finishes its work when asked to
//! cancel, one that hands its task on as it refuses a cancel, one that
//! reports a burst of artifacts, one that reports artifacts until stopped,
//! one that reports its ids with a large artifact, and cards with chosen
//! capabilities.

use async_trait::async_trait;
use baton::agents::{Agent, AgentError, AgentEvent, AgentEvents, AgentRequest, UpstreamRef};
use baton::protocol::{
    AgentCapabilities, AgentCard, AgentExtension, AgentInterface, AgentSkill, Artifact, Part, Task,
    TaskState,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Semaphore;

/// A minimal valid card.
pub fn card(name: &str) -> AgentCard {
    AgentCard {
        name: name.into(),
        description: format!("test agent {name}"),
        supported_interfaces: vec![AgentInterface {
            url: "http://localhost/unused".into(),
            protocol_binding: "JSONRPC".into(),
            tenant: String::new(),
            protocol_version: "1.0".into(),
        }],
        version: "1.0.0".into(),
        capabilities: AgentCapabilities::default(),
        default_input_modes: vec!["text/plain".into()],
        default_output_modes: vec!["text/plain".into()],
        skills: vec![AgentSkill {
            id: "test".into(),
            name: "Test".into(),
            description: "test skill".into(),
            tags: vec!["test".into()],
            ..AgentSkill::default()
        }],
        ..AgentCard::default()
    }
}

/// Reports WORKING, then waits for a permit before completing with an artifact.
#[derive(Clone)]
pub struct GatedAgent {
    card: AgentCard,
    /// Each permit lets one execution finish.
    pub gate: Arc<Semaphore>,
    /// Reports nothing before its permit: no task exists until then.
    quiet: bool,
}

impl GatedAgent {
    /// A closed gate.
    pub fn new() -> Self {
        Self {
            card: card("gated"),
            gate: Arc::new(Semaphore::new(0)),
            quiet: false,
        }
    }

    /// A closed gate, before which the agent says nothing at all.
    pub fn quiet() -> Self {
        Self {
            quiet: true,
            ..Self::new()
        }
    }

    /// Lets `n` executions finish.
    pub fn release(&self, n: usize) {
        self.gate.add_permits(n);
    }
}

#[async_trait]
impl Agent for GatedAgent {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    async fn execute(&self, request: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        if !self.quiet {
            events.status(TaskState::Working, None).await;
        }
        tokio::select! {
            permit = self.gate.acquire() => permit.expect("gate open").forget(),
            _ = request.cancel.cancelled() => return Ok(()),
        }
        events
            .artifact(Artifact {
                artifact_id: "result".into(),
                parts: vec![Part::text(format!("done: {}", request.message.text()))],
                ..Artifact::default()
            })
            .await;
        events.status(TaskState::Completed, None).await;
        Ok(())
    }
}

/// Completes at once, but its first driver panics before the agent is
/// called (in [`Agent::takes_follow_ups`]): a bug in the gateway, whose
/// send must not keep its idempotency key.
pub struct PanicsOnceAgent {
    card: AgentCard,
    panicked: std::sync::atomic::AtomicBool,
}

impl PanicsOnceAgent {
    pub fn new() -> Self {
        Self {
            card: card("panics"),
            panicked: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

#[async_trait]
impl Agent for PanicsOnceAgent {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    fn takes_follow_ups(&self) -> bool {
        if !self
            .panicked
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            panic!("a driver's bug, once");
        }
        false
    }

    async fn execute(&self, _: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        events.status(TaskState::Completed, None).await;
        Ok(())
    }
}

/// Fails before reporting anything.
pub struct FailingAgent(pub AgentCard);

#[async_trait]
impl Agent for FailingAgent {
    fn card(&self) -> &AgentCard {
        &self.0
    }

    async fn execute(&self, _: AgentRequest, _: AgentEvents) -> Result<(), AgentError> {
        Err(AgentError::Failed("the model backend is down".into()))
    }
}

/// Asks for input on a new task, then works on the answer until stopped.
pub struct AsksThenWorks(pub AgentCard);

#[async_trait]
impl Agent for AsksThenWorks {
    fn card(&self) -> &AgentCard {
        &self.0
    }

    async fn execute(&self, request: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        if request.task.is_none() {
            events.status(TaskState::InputRequired, None).await;
            return Ok(());
        }
        events.status(TaskState::Working, None).await;
        std::future::pending().await
    }
}

/// Works until canceled, and never answers a CancelTask.
pub struct UnresponsiveAgent(pub AgentCard);

#[async_trait]
impl Agent for UnresponsiveAgent {
    fn card(&self) -> &AgentCard {
        &self.0
    }

    async fn execute(&self, _: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        events.status(TaskState::Working, None).await;
        std::future::pending().await
    }

    async fn cancel(
        &self,
        _: &baton::protocol::Task,
        _: Option<&baton::agents::UpstreamRef>,
    ) -> Result<(), AgentError> {
        std::future::pending().await
    }
}

/// Works until canceled, and refuses every CancelTask with JSON-RPC error
/// `code`, as a remote agent that forgot its task (-32001) or holds it past
/// canceling (-32002) would.
pub struct RefusingCancelAgent {
    pub card: AgentCard,
    pub code: i64,
}

#[async_trait]
impl Agent for RefusingCancelAgent {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    async fn execute(&self, request: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        work_until_canceled(&request, &events).await
    }

    async fn cancel(
        &self,
        _: &baton::protocol::Task,
        _: Option<&baton::agents::UpstreamRef>,
    ) -> Result<(), AgentError> {
        Err(AgentError::Refused {
            code: self.code,
            message: "refused by the test agent".into(),
            data: None,
        })
    }
}

/// Ends without reporting anything.
pub struct SilentAgent(pub AgentCard);

#[async_trait]
impl Agent for SilentAgent {
    fn card(&self) -> &AgentCard {
        &self.0
    }

    async fn execute(&self, _: AgentRequest, _: AgentEvents) -> Result<(), AgentError> {
        Ok(())
    }
}

/// Completes at once; its card is given, so capabilities can be chosen.
pub struct PlainAgent(pub AgentCard);

#[async_trait]
impl Agent for PlainAgent {
    fn card(&self) -> &AgentCard {
        &self.0
    }

    async fn execute(&self, _: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        events.status(TaskState::Completed, None).await;
        Ok(())
    }
}

/// Reports `artifacts` artifacts (`chunk-0`, `chunk-1`, …) as fast as it
/// can, then pauses before it completes, so that the burst's writes are not
/// the terminal one (a terminal write's events are not kept for replay).
pub struct BurstAgent {
    /// How many artifacts.
    pub artifacts: usize,
    /// Its card.
    pub card: AgentCard,
}

#[async_trait]
impl Agent for BurstAgent {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    async fn execute(&self, _: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        for chunk in 0..self.artifacts {
            let artifact = Artifact {
                artifact_id: format!("chunk-{chunk}"),
                parts: vec![Part::text(chunk.to_string())],
                ..Artifact::default()
            };
            events.artifact(artifact).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        events.status(TaskState::Completed, None).await;
        Ok(())
    }
}

/// Reports WORKING, then an artifact (`note-0`, `note-1`, …) every 5 ms
/// until its turn is canceled or dropped; never completes.
#[derive(Clone)]
pub struct ChattyAgent {
    card: AgentCard,
    /// Artifacts reported so far.
    pub reported: Arc<AtomicUsize>,
    /// Each artifact's text is padded to this many bytes.
    note_bytes: usize,
    /// After this many artifacts the agent completes the task.
    most_notes: usize,
}

impl ChattyAgent {
    /// A chatty agent named `name`.
    pub fn new(name: &str) -> Self {
        Self {
            card: card(name),
            reported: Arc::default(),
            note_bytes: 0,
            most_notes: usize::MAX,
        }
    }

    /// A chatty agent whose every artifact holds `note_bytes` of text, and
    /// which completes the task after 64 of them.
    pub fn with_note_bytes(name: &str, note_bytes: usize) -> Self {
        Self {
            note_bytes,
            most_notes: 64,
            ..Self::new(name)
        }
    }

    /// Artifacts reported so far.
    pub fn reported(&self) -> usize {
        self.reported.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Agent for ChattyAgent {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    async fn execute(&self, request: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        events.status(TaskState::Working, None).await;
        loop {
            tokio::select! {
                () = request.cancel.cancelled() => return Ok(()),
                () = tokio::time::sleep(std::time::Duration::from_millis(5)) => {}
            }
            let note = self.reported.fetch_add(1, Ordering::SeqCst);
            if note == self.most_notes {
                events.status(TaskState::Completed, None).await;
                return Ok(());
            }
            let artifact = padded(format!("note-{note}"), note, self.note_bytes);
            events.artifact(artifact).await;
        }
    }
}

/// Reports WORKING, then, in one report, its own ids, an artifact of
/// `artifact_bytes` and COMPLETED; keeps the ids each cancel named.
/// [`BindsInLargeReport::at_once`] makes that report its first.
pub struct BindsInLargeReport {
    card: AgentCard,
    artifact_bytes: usize,
    at_once: bool,
    /// The ids this agent reports as its own.
    pub ids: UpstreamRef,
    /// The ids each cancel named.
    pub cancels: Arc<Mutex<Vec<Option<UpstreamRef>>>>,
}

impl BindsInLargeReport {
    /// An agent named `name`.
    pub fn new(name: &str, artifact_bytes: usize) -> Self {
        Self {
            card: card(name),
            artifact_bytes,
            at_once: false,
            ids: UpstreamRef {
                task_id: "own-task".into(),
                context_id: "own-context".into(),
            },
            cancels: Arc::default(),
        }
    }

    /// The same agent, whose first report is the large one.
    pub fn at_once(self) -> Self {
        Self {
            at_once: true,
            ..self
        }
    }
}

#[async_trait]
impl Agent for BindsInLargeReport {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    async fn execute(&self, _: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        if !self.at_once {
            working_alone(&events).await;
        }
        events.send(AgentEvent::Bound(self.ids.clone())).await;
        let large = padded("large".into(), 0, self.artifact_bytes);
        events.artifact(large).await;
        events.status(TaskState::Completed, None).await;
        Ok(())
    }

    async fn cancel(&self, _: &Task, upstream: Option<&UpstreamRef>) -> Result<(), AgentError> {
        self.cancels.lock().unwrap().push(upstream.cloned());
        Ok(())
    }
}

/// Artifact `id`, whose text is `note` followed by dots up to `bytes` bytes.
fn padded(id: String, note: usize, bytes: usize) -> Artifact {
    let mut text = note.to_string();
    let pad = bytes.saturating_sub(text.len());
    text.extend(std::iter::repeat_n('.', pad));
    Artifact {
        artifact_id: id,
        parts: vec![Part::text(text)],
        ..Artifact::default()
    }
}

/// Reports WORKING as a report of its own: the gateway takes what an agent
/// reported each time the agent waits, and the sends after this one, which
/// never wait, come as the next report.
async fn working_alone(events: &AgentEvents) {
    events.status(TaskState::Working, None).await;
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}

/// A card declaring a required extension.
pub fn card_requiring_extension(uri: &str) -> AgentCard {
    let mut card = card("strict");
    card.capabilities.extensions.push(AgentExtension {
        uri: uri.into(),
        description: "must be activated".into(),
        required: true,
        params: None,
    });
    card
}

/// A card that declares an extended card the agent does not provide.
pub fn card_with_unconfigured_extended_card() -> AgentCard {
    let mut card = card("extended");
    card.capabilities.extended_agent_card = Some(true);
    card
}

/// Answers each message only after `delay`, always with its one task
/// `same-task`, as an agent that deduplicates retries by messageId would;
/// counts the CancelTasks it gets.
pub struct DeduplicatingLateAgent {
    pub card: AgentCard,
    pub delay: std::time::Duration,
    pub cancels: Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait]
impl Agent for DeduplicatingLateAgent {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    fn creates_remote_tasks(&self) -> bool {
        true
    }

    async fn execute(&self, request: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        tokio::select! {
            _ = tokio::time::sleep(self.delay) => {}
            _ = request.cancel.cancelled() => return Ok(()),
        }
        let bound = baton::agents::UpstreamRef {
            task_id: "same-task".into(),
            context_id: String::new(),
        };
        events.send(baton::agents::AgentEvent::Bound(bound)).await;
        work_until_canceled(&request, &events).await
    }

    async fn cancel(
        &self,
        _: &baton::protocol::Task,
        _: Option<&baton::agents::UpstreamRef>,
    ) -> Result<(), AgentError> {
        self.cancels
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

/// Reports WORKING, then works until the turn is canceled.
async fn work_until_canceled(
    request: &AgentRequest,
    events: &AgentEvents,
) -> Result<(), AgentError> {
    events.status(TaskState::Working, None).await;
    request.cancel.cancelled().await;
    Ok(())
}

/// Works until a CancelTask arrives, then finishes its work with a
/// `refund` artifact before it answers: the answer waits for
/// [`FinishesOnCancel::answer`], so that what the gateway does with the
/// result meanwhile can be watched. It answers that it canceled, or, as a
/// remote agent whose task ended would, "not cancelable" (-32002).
pub struct FinishesOnCancel {
    card: AgentCard,
    refuses: bool,
    finish: Arc<tokio::sync::Notify>,
    /// Lets the held CancelTask answer.
    pub answer: Arc<tokio::sync::Notify>,
}

impl FinishesOnCancel {
    /// An agent named `name`; `refuses` picks its answer to a cancel.
    pub fn new(name: &str, refuses: bool) -> Self {
        Self {
            card: card(name),
            refuses,
            finish: Arc::default(),
            answer: Arc::default(),
        }
    }

    /// Another handle on the same agent.
    pub fn handle(&self) -> Self {
        Self {
            card: self.card.clone(),
            refuses: self.refuses,
            finish: self.finish.clone(),
            answer: self.answer.clone(),
        }
    }
}

#[async_trait]
impl Agent for FinishesOnCancel {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    async fn execute(&self, request: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        if !work_until(&self.finish, &request, &events).await {
            return Ok(());
        }
        events
            .artifact(Artifact {
                artifact_id: "refund".into(),
                name: "refund".into(),
                parts: vec![Part::text("refunded")],
                ..Artifact::default()
            })
            .await;
        events.status(TaskState::Completed, None).await;
        Ok(())
    }

    async fn cancel(
        &self,
        _: &baton::protocol::Task,
        _: Option<&baton::agents::UpstreamRef>,
    ) -> Result<(), AgentError> {
        self.finish.notify_one();
        self.answer.notified().await;
        if self.refuses {
            return Err(already_completed());
        }
        Ok(())
    }
}

/// Works until a CancelTask arrives, answers it at once that its task cannot
/// be canceled (-32002, as a remote agent whose task just ended would), and
/// only then ends its task with `payload`, a handoff to another agent: the
/// gateway meets the "cannot be canceled" before the transfer.
pub struct HandsOnWhenCanceled {
    card: AgentCard,
    payload: serde_json::Value,
    hand_on: Arc<tokio::sync::Notify>,
    /// CancelTasks received.
    pub cancels: Arc<std::sync::atomic::AtomicUsize>,
}

impl HandsOnWhenCanceled {
    /// An agent named `name`, handing on with `payload` once canceled.
    pub fn new(name: &str, payload: serde_json::Value) -> Self {
        Self {
            card: card(name),
            payload,
            hand_on: Arc::default(),
            cancels: Arc::default(),
        }
    }
}

#[async_trait]
impl Agent for HandsOnWhenCanceled {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    async fn execute(&self, request: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        if !work_until(&self.hand_on, &request, &events).await {
            return Ok(());
        }
        let mut handoff = Part::data(self.payload.clone());
        handoff.media_type = baton::handoff::payload::HANDOFF_MEDIA_TYPE.into();
        let message = baton::protocol::Message::agent(vec![handoff]);
        events.status(TaskState::Completed, Some(message)).await;
        Ok(())
    }

    async fn cancel(
        &self,
        _: &baton::protocol::Task,
        _: Option<&baton::agents::UpstreamRef>,
    ) -> Result<(), AgentError> {
        self.cancels
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Handed on just after this answer reaches the gateway.
        let hand_on = self.hand_on.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            hand_on.notify_one();
        });
        Err(already_completed())
    }
}

/// Reports WORKING, then, in one report, `artifacts` artifacts of
/// `artifact_bytes` each and a transfer with `payload`: results brought
/// along by a transfer.
pub struct TransfersWithArtifacts {
    card: AgentCard,
    payload: serde_json::Value,
    artifacts: usize,
    artifact_bytes: usize,
    at_once: bool,
}

impl TransfersWithArtifacts {
    /// An agent named `name`.
    pub fn new(
        name: &str,
        payload: serde_json::Value,
        artifacts: usize,
        artifact_bytes: usize,
    ) -> Self {
        Self {
            card: card(name),
            payload,
            artifacts,
            artifact_bytes,
            at_once: false,
        }
    }

    /// The same agent, reporting no WORKING first: the transfer is its
    /// first report.
    pub fn at_once(self) -> Self {
        Self {
            at_once: true,
            ..self
        }
    }
}

#[async_trait]
impl Agent for TransfersWithArtifacts {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    async fn execute(&self, _: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        if !self.at_once {
            working_alone(&events).await;
        }
        for note in 0..self.artifacts {
            let artifact = padded(format!("result-{note}"), note, self.artifact_bytes);
            events.artifact(artifact).await;
        }
        let mut handoff = Part::data(self.payload.clone());
        handoff.media_type = baton::handoff::payload::HANDOFF_MEDIA_TYPE.into();
        let message = baton::protocol::Message::agent(vec![handoff]);
        events.status(TaskState::Completed, Some(message)).await;
        Ok(())
    }
}

/// Reports WORKING, then waits for `go`; false if the task was canceled first.
async fn work_until(
    go: &tokio::sync::Notify,
    request: &AgentRequest,
    events: &AgentEvents,
) -> bool {
    events.status(TaskState::Working, None).await;
    tokio::select! {
        _ = go.notified() => true,
        _ = request.cancel.cancelled() => false,
    }
}

/// A remote agent's answer to a CancelTask for a task that has ended.
fn already_completed() -> AgentError {
    AgentError::Refused {
        code: -32002,
        message: "the task is already completed".into(),
        data: None,
    }
}
