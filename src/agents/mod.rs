//! Agents the gateway delivers messages to, behind one trait.
//!
//! An agent receives an [`AgentRequest`] and reports what happens through an
//! [`AgentEvents`] sink: a direct message, status changes, artifacts. The
//! gateway turns those into ledger events. Built-in agents live here; remote
//! A2A agents implement the same trait.

pub mod echo;
pub mod scenario;

use crate::protocol::{AgentCard, Artifact, Message, Task, TaskState, TaskStatus};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

/// Where a task lives at its agent, when the agent keeps ids of its own (a
/// remote agent). The gateway's ids are what callers see; these are what the
/// agent sees.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UpstreamRef {
    /// The agent's task id.
    pub task_id: String,
    /// The agent's context id.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub context_id: String,
}

/// What an agent is asked to do.
#[derive(Clone, Debug)]
pub struct AgentRequest {
    /// The gateway task id (new or continued).
    pub task_id: String,
    /// The context id.
    pub context_id: String,
    /// The incoming message, with `taskId` and `contextId` filled in.
    pub message: Message,
    /// The task so far, when the message continues one.
    pub task: Option<Task>,
    /// The task's ids at the agent, when the message continues one there.
    pub upstream: Option<UpstreamRef>,
    /// The caller is streaming.
    pub streaming: bool,
    /// Media types the caller accepts.
    pub accepted_output_modes: Vec<String>,
    /// Canceled when the task is canceled or the gateway shuts down.
    pub cancel: CancellationToken,
}

impl AgentRequest {
    /// The request for the agent, leaving `self` without its message and
    /// task (the parts a turn that is never sent again does not keep).
    pub fn hand_over(&mut self) -> AgentRequest {
        let message = std::mem::take(&mut self.message);
        let task = self.task.take();
        // What is left is cheap to clone, and a new field is copied too
        // (take it above instead if it is large).
        AgentRequest {
            message,
            task,
            ..self.clone()
        }
    }
}

/// One thing an agent reports.
#[derive(Clone, Debug, PartialEq)]
pub enum AgentEvent {
    /// A direct reply; valid only as the first event of a new exchange, and
    /// then no task is created.
    Message(Message),
    /// The task enters `state`, optionally with a message.
    Status {
        /// The new state.
        state: TaskState,
        /// A message for the status (a question, an error).
        message: Option<Message>,
    },
    /// The agent's own ids for the task; the gateway keeps them with its task.
    Bound(UpstreamRef),
    /// The agent's task is still in `state` (WORKING for SUBMITTED): said
    /// after an artifact carrying a handoff payload, whose transfer waits
    /// for the state the agent leaves its task in. Recorded nowhere.
    StillIn(TaskState),
    /// An artifact, or a chunk of one.
    Artifact {
        /// The artifact.
        artifact: Artifact,
        /// Append to the artifact with the same id.
        append: bool,
        /// Last chunk of this artifact.
        last_chunk: bool,
    },
}

/// A message sent to a task while an execution follows it at its agent
/// (a caller adding to a WORKING task): that execution forwards it, so the
/// task keeps one feed from the agent (DESIGN.md §2), and says whether the
/// agent took it. Dropped unanswered, the execution had ended first.
#[derive(Debug)]
pub struct FollowUp {
    /// The message, with the gateway's task and context ids.
    pub message: Message,
    /// Media types its caller accepts.
    pub accepted_output_modes: Vec<String>,
    /// The AUTH_REQUIRED status the message answers, as the gateway held
    /// it: the gateway makes the task WORKING if it still holds that status
    /// when the agent took the message, and the execution takes the task as
    /// WORKING if it last reported that status.
    pub answers: Option<TaskStatus>,
    /// The agent's answer: `Ok` once it took the message.
    pub taken: oneshot::Sender<Result<(), AgentError>>,
    /// Closed once the task's history holds the message the agent took (or
    /// the gateway gave up writing it): only then does the execution report
    /// what the agent made of it, which goes after it.
    pub recorded: oneshot::Receiver<()>,
}

/// Where follow-ups to a task come in. Boxed: the channel's first block of
/// slots is allocated with it, for every execution that may follow a task.
pub type FollowUpReceiver = mpsc::Receiver<Box<FollowUp>>;

/// Where follow-ups to a task are sent.
pub type FollowUpSender = mpsc::Sender<Box<FollowUp>>;

/// Where an agent sends its events, and where follow-ups to its task come
/// in while it follows the task ([`Agent::takes_follow_ups`]).
#[derive(Debug)]
pub struct AgentEvents {
    sender: mpsc::Sender<AgentEvent>,
    follow_ups: Option<FollowUpReceiver>,
    /// How many of the events sent the gateway has handled (written, or
    /// let go), when it counts: with follow-ups.
    handled: Option<watch::Receiver<u64>>,
}

impl AgentEvents {
    /// A sink and the receiver the gateway reads from.
    pub fn channel(capacity: usize) -> (Self, mpsc::Receiver<AgentEvent>) {
        let (sender, receiver) = mpsc::channel(capacity);
        let events = Self {
            sender,
            follow_ups: None,
            handled: None,
        };
        (events, receiver)
    }

    /// The sink, with follow-ups to the task coming in on `follow_ups`.
    pub fn with_follow_ups(mut self, follow_ups: FollowUpReceiver) -> Self {
        self.follow_ups = Some(follow_ups);
        self
    }

    /// Whether follow-ups to the task come in here.
    pub fn has_follow_ups(&self) -> bool {
        self.follow_ups.is_some()
    }

    /// The sink, with the gateway counting in `handled` the events it has
    /// handled ([`Self::until_handled`]).
    pub fn with_handled(mut self, handled: watch::Receiver<u64>) -> Self {
        self.handled = Some(handled);
        self
    }

    /// Waits until the gateway has handled the first `sent` events, so that
    /// a follow-up forwarded now is written after them. At once when the
    /// gateway does not count, or no longer listens.
    pub async fn until_handled(&mut self, sent: u64) {
        if let Some(handled) = &mut self.handled {
            let _ = handled.wait_for(|&count| count >= sent).await;
        }
    }

    /// The follow-ups to the task, for the one execution that forwards them.
    pub fn take_follow_ups(&mut self) -> Option<FollowUpReceiver> {
        self.follow_ups.take()
    }

    /// Reports one event; false when the gateway no longer listens.
    pub async fn send(&self, event: AgentEvent) -> bool {
        self.sender.send(event).await.is_ok()
    }

    /// Reports a status.
    pub async fn status(&self, state: TaskState, message: Option<Message>) -> bool {
        self.send(AgentEvent::Status { state, message }).await
    }

    /// Reports a complete artifact.
    pub async fn artifact(&self, artifact: Artifact) -> bool {
        self.send(AgentEvent::Artifact {
            artifact,
            append: false,
            last_chunk: true,
        })
        .await
    }
}

/// Why an agent failed. Remote faults stay distinct, so callers can tell an
/// agent that is down from one that answered nonsense.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AgentError {
    /// The agent refused the input as invalid.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The agent failed while working.
    #[error("agent failed: {0}")]
    Failed(String),
    /// The agent could not be reached (connection refused, DNS, refused by the outbound guard).
    #[error("agent unreachable: {0}")]
    Unreachable(String),
    /// The agent did not answer in time.
    #[error("agent timed out: {0}")]
    Timeout(String),
    /// The agent answered with something that is not JSON.
    #[error("agent answered with non-JSON: {0}")]
    NotJson(String),
    /// The agent answered with JSON that is not a valid A2A reply.
    #[error("agent answered with an invalid A2A response: {0}")]
    InvalidResponse(String),
    /// The agent answered with a JSON-RPC error, passed on as it is.
    #[error("{message}")]
    Refused {
        /// The agent's error code.
        code: i64,
        /// The agent's message.
        message: String,
        /// The agent's error data.
        data: Option<serde_json::Value>,
    },
}

/// An agent the gateway delivers messages to.
#[async_trait]
pub trait Agent: Send + Sync + 'static {
    /// The agent's card as registered (interfaces are rewritten on publication).
    fn card(&self) -> &AgentCard;

    /// The extended card for authenticated callers, when the agent has one.
    fn extended_card(&self) -> Option<AgentCard> {
        None
    }

    /// Whether the agent may create a task of its own, learned only from
    /// its answer (`AgentEvent::Bound`). A handoff attempt abandoned before
    /// that answer is then followed to cancel the task; an in-process
    /// agent's work just ends with the turn. A wrapper around another
    /// agent must pass this on.
    fn creates_remote_tasks(&self) -> bool {
        false
    }

    /// Whether an execution follows its task at the agent until it settles
    /// and forwards the [`FollowUp`]s that `events` brings meanwhile. Else a
    /// message to a task being worked on starts an execution of its own.
    fn takes_follow_ups(&self) -> bool {
        false
    }

    /// Handles one message, reporting through `events` until done.
    async fn execute(&self, request: AgentRequest, events: AgentEvents) -> Result<(), AgentError>;

    /// Picks up a task the agent was working on when the gateway stopped,
    /// reporting through `events` as `execute` does. Agents that cannot
    /// (in-process work is lost with the process) say so, and the gateway
    /// fails the task with the reason.
    /// `cancel` fires at a gateway cancel or shutdown.
    async fn recover(
        &self,
        _task: &Task,
        _upstream: Option<&UpstreamRef>,
        _events: AgentEvents,
        _cancel: CancellationToken,
    ) -> Result<(), AgentError> {
        Err(AgentError::Failed(
            "the gateway restarted while this agent was working; its work cannot be resumed".into(),
        ))
    }

    /// Asks the agent to stop work on a task. `Ok` means the agent canceled
    /// it (or keeps no state of its own) and the gateway records the cancel;
    /// an error is the agent's answer, e.g. `Refused` with -32002.
    async fn cancel(
        &self,
        _task: &Task,
        _upstream: Option<&UpstreamRef>,
    ) -> Result<(), AgentError> {
        Ok(())
    }
}

/// A registered agent: its id and implementation.
#[derive(Clone)]
pub struct AgentHandle {
    /// The agent id (path segment and tenant).
    pub id: String,
    /// The implementation.
    pub agent: Arc<dyn Agent>,
}

/// Parses a card shipped in `agent-cards/`; panics only on a broken build.
pub(crate) fn builtin_card(json: &str) -> AgentCard {
    serde_json::from_str(json).expect("built-in agent card is valid JSON")
}

/// The built-in agents, by id.
pub fn builtin_agents() -> Vec<AgentHandle> {
    vec![
        AgentHandle {
            id: "echo".into(),
            agent: Arc::new(echo::EchoAgent::new()),
        },
        AgentHandle {
            id: "scenario".into(),
            agent: Arc::new(scenario::ScenarioAgent::new()),
        },
    ]
}
