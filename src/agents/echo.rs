//! The built-in `echo` agent: completes every task with an artifact that
//! echoes the input parts.

use super::{Agent, AgentError, AgentEvents, AgentRequest, builtin_card};
use crate::protocol::{AgentCard, Artifact, TaskState};
use async_trait::async_trait;

/// Echoes its input as an artifact named `echo`.
pub struct EchoAgent {
    card: AgentCard,
}

impl EchoAgent {
    /// The agent with its card from `agent-cards/echo.json`.
    pub fn new() -> Self {
        Self {
            card: builtin_card(include_str!("../../agent-cards/echo.json")),
        }
    }
}

impl Default for EchoAgent {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Agent for EchoAgent {
    fn card(&self) -> &AgentCard {
        &self.card
    }

    fn extended_card(&self) -> Option<AgentCard> {
        Some(self.card.clone())
    }

    async fn execute(&self, request: AgentRequest, events: AgentEvents) -> Result<(), AgentError> {
        events.status(TaskState::Working, None).await;
        events
            .artifact(Artifact {
                artifact_id: uuid::Uuid::new_v4().to_string(),
                name: "echo".into(),
                parts: request.message.parts.clone(),
                ..Artifact::default()
            })
            .await;
        events.status(TaskState::Completed, None).await;
        Ok(())
    }
}
