//! The built-in `echo` agent: completes every task with an artifact that
//! echoes the input parts, tailored to the caller's `acceptedOutputModes`
//! (text becomes JSON data for a caller that accepts JSON but not text).

use super::{Agent, AgentError, AgentEvents, AgentRequest, builtin_card};
use crate::gateway::validate::media_type_matches;
use crate::protocol::{AgentCard, Artifact, Part, PartContent, TaskState};
use async_trait::async_trait;
use serde_json::json;

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

/// Rewrites text parts as JSON data when the caller accepts JSON but not text.
fn tailor(parts: Vec<Part>, accepted: &[String]) -> Vec<Part> {
    let accepts = |mode: &str| accepted.iter().any(|a| media_type_matches(a, mode));
    if accepted.is_empty() || accepts("text/plain") || !accepts("application/json") {
        return parts;
    }
    parts
        .into_iter()
        .map(|part| match part.content {
            PartContent::Text(text) => {
                let mut data = Part::data(json!({ "text": text }));
                data.media_type = "application/json".into();
                data
            }
            _ => part,
        })
        .collect()
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
                parts: tailor(
                    request.message.parts.clone(),
                    &request.accepted_output_modes,
                ),
                ..Artifact::default()
            })
            .await;
        events.status(TaskState::Completed, None).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_becomes_data_for_json_only_callers() {
        let parts = vec![Part::text("hi")];
        assert_eq!(tailor(parts.clone(), &[]), parts);
        assert_eq!(tailor(parts.clone(), &["text/*".into()]), parts);
        let tailored = tailor(parts, &["application/json".into()]);
        assert_eq!(
            tailored[0].content,
            PartContent::Data(json!({"text": "hi"}))
        );
        assert_eq!(tailored[0].media_type, "application/json");
    }
}
