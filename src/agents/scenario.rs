//! The built-in `scenario` agent: behaves per messageId prefix as the A2A
//! conformance suite's scenario files describe, so the suite can run against
//! Baton with nothing else started.

use super::{Agent, AgentError, AgentEvent, AgentEvents, AgentRequest, builtin_card};
use crate::protocol::{AgentCard, Artifact, Message, Part, PartContent, TaskState};
use async_trait::async_trait;
use serde_json::json;
use std::time::Duration;

/// One behaviour of the suite's scenarios.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    CompleteTask,
    ArtifactText,
    ArtifactFile,
    ArtifactFileUrl,
    ArtifactData,
    MessageResponse,
    InputRequired,
    RejectTask,
    StreamText(&'static str),
    StreamCompleteOnly,
    StreamFile,
    StreamChunked,
    LongRunning,
}

/// Prefixes, longest first where one is a prefix of another.
const PREFIXES: &[(&str, Scenario)] = &[
    ("tck-complete-task", Scenario::CompleteTask),
    ("tck-artifact-text", Scenario::ArtifactText),
    ("tck-artifact-file-url", Scenario::ArtifactFileUrl),
    ("tck-artifact-file", Scenario::ArtifactFile),
    ("tck-artifact-data", Scenario::ArtifactData),
    ("tck-message-response", Scenario::MessageResponse),
    ("tck-input-required", Scenario::InputRequired),
    ("tck-reject-task", Scenario::RejectTask),
    (
        "tck-stream-001",
        Scenario::StreamText("Stream hello from TCK"),
    ),
    ("tck-stream-002", Scenario::StreamCompleteOnly),
    (
        "tck-stream-003",
        Scenario::StreamText("Stream task lifecycle"),
    ),
    (
        "tck-stream-ordering-001",
        Scenario::StreamText("Ordered output"),
    ),
    (
        "tck-stream-artifact-text",
        Scenario::StreamText("Streamed text content"),
    ),
    ("tck-stream-artifact-file", Scenario::StreamFile),
    ("tck-stream-artifact-chunked", Scenario::StreamChunked),
    ("test-resubscribe-message-id", Scenario::LongRunning),
];

fn scenario_for(message_id: &str) -> Scenario {
    PREFIXES
        .iter()
        .find(|(prefix, _)| message_id.starts_with(prefix))
        .map(|(_, scenario)| *scenario)
        .unwrap_or(Scenario::CompleteTask)
}

/// Plays the conformance suite's scenarios.
pub struct ScenarioAgent {
    card: AgentCard,
    long_running: Duration,
}

impl ScenarioAgent {
    /// The agent with its card from `agent-cards/scenario.json`; the
    /// long-running scenario lasts twice the suite's streaming timeout
    /// (`TCK_STREAMING_TIMEOUT`, default 2 s).
    pub fn new() -> Self {
        let streaming_timeout = std::env::var("TCK_STREAMING_TIMEOUT")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v > 0.0)
            .unwrap_or(2.0);
        Self {
            card: builtin_card(include_str!("../../agent-cards/scenario.json")),
            long_running: Duration::from_secs_f64(streaming_timeout * 2.0),
        }
    }
}

impl Default for ScenarioAgent {
    fn default() -> Self {
        Self::new()
    }
}

fn text_artifact(text: &str) -> Artifact {
    Artifact {
        artifact_id: uuid::Uuid::new_v4().to_string(),
        parts: vec![Part::text(text)],
        ..Artifact::default()
    }
}

fn file_artifact(content: PartContent) -> Artifact {
    let mut part = Part::from_content(content);
    part.filename = "output.txt".into();
    part.media_type = "text/plain".into();
    Artifact {
        artifact_id: uuid::Uuid::new_v4().to_string(),
        name: "output.txt".into(),
        parts: vec![part],
        ..Artifact::default()
    }
}

fn agent_message(request: &AgentRequest, text: &str) -> Message {
    let mut message = Message::agent(vec![Part::text(text)]);
    message.context_id = request.context_id.clone();
    message
}

#[async_trait]
impl Agent for ScenarioAgent {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    fn extended_card(&self) -> Option<AgentCard> {
        Some(self.card.clone())
    }

    async fn execute(&self, request: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        let scenario = scenario_for(&request.message.message_id);
        let complete = |message: Option<Message>| AgentEvent::Status {
            state: TaskState::Completed,
            message,
        };
        let plan: Vec<AgentEvent> = match scenario {
            Scenario::CompleteTask => {
                let mut message = agent_message(&request, "Hello from TCK");
                message.task_id = request.task_id.clone();
                vec![complete(Some(message))]
            }
            Scenario::ArtifactText => vec![
                artifact_event(text_artifact("Generated text content")),
                complete(None),
            ],
            Scenario::ArtifactFile => vec![
                artifact_event(file_artifact(PartContent::Raw(
                    b"Generated file content".to_vec(),
                ))),
                complete(None),
            ],
            Scenario::ArtifactFileUrl => vec![
                artifact_event(file_artifact(PartContent::Url(
                    "https://example.com/output.txt".into(),
                ))),
                complete(None),
            ],
            Scenario::ArtifactData => vec![
                artifact_event(Artifact {
                    artifact_id: uuid::Uuid::new_v4().to_string(),
                    parts: vec![Part::data(json!({"key": "value", "count": 42}))],
                    ..Artifact::default()
                }),
                complete(None),
            ],
            Scenario::MessageResponse => {
                vec![AgentEvent::Message(agent_message(
                    &request,
                    "Direct message response",
                ))]
            }
            Scenario::InputRequired => {
                let mut question = agent_message(&request, "Please provide more input.");
                question.task_id = request.task_id.clone();
                vec![AgentEvent::Status {
                    state: TaskState::InputRequired,
                    message: Some(question),
                }]
            }
            Scenario::RejectTask => {
                let mut reason = agent_message(&request, "rejected");
                reason.task_id = request.task_id.clone();
                vec![AgentEvent::Status {
                    state: TaskState::Rejected,
                    message: Some(reason),
                }]
            }
            Scenario::StreamText(text) => vec![
                working(),
                artifact_event(text_artifact(text)),
                complete(None),
            ],
            Scenario::StreamCompleteOnly => vec![complete(None)],
            Scenario::StreamFile => vec![
                working(),
                artifact_event(file_artifact(PartContent::Raw(
                    b"Streamed file content".to_vec(),
                ))),
                complete(None),
            ],
            Scenario::StreamChunked => {
                let mut first = text_artifact("chunk-1 ");
                let mut second = first.clone();
                first.parts = vec![Part::text("chunk-1 ")];
                second.parts = vec![Part::text("chunk-2")];
                vec![
                    working(),
                    AgentEvent::Artifact {
                        artifact: first,
                        append: false,
                        last_chunk: false,
                    },
                    AgentEvent::Artifact {
                        artifact: second,
                        append: true,
                        last_chunk: true,
                    },
                    complete(None),
                ]
            }
            Scenario::LongRunning => {
                events.send(working()).await;
                tokio::select! {
                    _ = tokio::time::sleep(self.long_running) => {}
                    _ = request.cancel.cancelled() => return Ok(()),
                }
                vec![complete(None)]
            }
        };
        for event in plan {
            if !events.send(event).await {
                break;
            }
        }
        Ok(())
    }
}

fn working() -> AgentEvent {
    AgentEvent::Status {
        state: TaskState::Working,
        message: None,
    }
}

fn artifact_event(artifact: Artifact) -> AgentEvent {
    AgentEvent::Artifact {
        artifact,
        append: false,
        last_chunk: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longer_prefixes_win() {
        assert_eq!(
            scenario_for("tck-artifact-file-url-1"),
            Scenario::ArtifactFileUrl
        );
        assert_eq!(scenario_for("tck-artifact-file-1"), Scenario::ArtifactFile);
        assert_eq!(
            scenario_for("tck-stream-artifact-file-x"),
            Scenario::StreamFile
        );
        assert_eq!(scenario_for("anything"), Scenario::CompleteTask);
    }
}
