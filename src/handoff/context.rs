//! The messages Baton builds for agents during a handoff (DESIGN.md §3.2,
//! §3.3): what a transfer's target receives under each context policy, and
//! the result a `returnToParent` handoff delivers back to its source.
//!
//! These are pure functions of the payload and the conversation, so each
//! policy is unit-tested here and the send path only measures the result.

use super::payload::{
    ContextPolicy, HANDOFF_MEDIA_TYPE, HANDOFF_RESULT_MEDIA_TYPE, HandoffPayload,
};
use crate::protocol::wire::ProtoEnum;
use crate::protocol::{Artifact, Message, Part, TaskState};
use serde_json::{Value, json};

/// Media type of the part carrying earlier messages (FULL and LAST_N).
pub const HISTORY_MEDIA_TYPE: &str = "application/vnd.baton.history.v1+json";

/// Payload fields a SUMMARY target receives: what routes and bounds the
/// work, the goal, the summary and the key facts; nothing else.
const SUMMARY_FIELDS: &[&str] = &[
    "handoffId",
    "from",
    "to",
    "toSkill",
    "reason",
    "goal",
    "summary",
    "keyFacts",
    "returnSchema",
    "context",
    "returnToParent",
];

/// The parts a transfer's target receives, by the payload's context policy:
/// - FULL: the payload and every earlier message;
/// - LAST_N: the payload and the last n messages;
/// - SUMMARY: the goal and summary as text, and the payload cut down to its
///   summary fields;
/// - STRUCTURED: the payload alone.
pub fn transfer_parts(data: &Value, payload: &HandoffPayload, history: &[Message]) -> Vec<Part> {
    match payload.context {
        ContextPolicy::Structured => vec![payload_part(data.clone())],
        ContextPolicy::Summary => {
            let mut text = payload.goal.clone();
            if !payload.summary.is_empty() {
                text.push_str("\n\n");
                text.push_str(&payload.summary);
            }
            vec![Part::text(text), payload_part(summary_fields(data))]
        }
        ContextPolicy::Full => vec![payload_part(data.clone()), history_part(history)],
        ContextPolicy::LastN(n) => {
            let from = history.len().saturating_sub(n as usize);
            vec![payload_part(data.clone()), history_part(&history[from..])]
        }
    }
}

/// The earlier messages a direct handoff's target receives besides the
/// caller's own parts: FULL and LAST_N add the parent task's conversation;
/// SUMMARY and STRUCTURED add nothing.
pub fn direct_history(policy: ContextPolicy, parent_history: &[Message]) -> Option<Part> {
    match policy {
        ContextPolicy::Full if !parent_history.is_empty() => Some(history_part(parent_history)),
        ContextPolicy::LastN(n) if !parent_history.is_empty() => {
            let from = parent_history.len().saturating_sub(n as usize);
            Some(history_part(&parent_history[from..]))
        }
        _ => None,
    }
}

/// The parts that return a handoff's result to its source: the target's
/// artifact parts, then `{handoffId, from, status, artifacts}`.
pub fn result_parts(
    handoff_id: &str,
    target: &str,
    state: TaskState,
    artifacts: &[Artifact],
) -> Vec<Part> {
    let mut parts: Vec<Part> = artifacts
        .iter()
        .flat_map(|artifact| artifact.parts.iter().cloned())
        .collect();
    let mut result = Part::data(json!({
        "handoffId": handoff_id,
        "from": target,
        "status": state.proto_name(),
        "artifacts": artifacts,
    }));
    result.media_type = HANDOFF_RESULT_MEDIA_TYPE.into();
    parts.push(result);
    parts
}

/// Size of a message as the target receives it, in bytes of JSON.
pub fn message_bytes(message: &Message) -> u64 {
    serde_json::to_vec(message).map_or(0, |bytes| bytes.len() as u64)
}

fn payload_part(data: Value) -> Part {
    let mut part = Part::data(data);
    part.media_type = HANDOFF_MEDIA_TYPE.into();
    part
}

fn history_part(messages: &[Message]) -> Part {
    let mut part = Part::data(json!({ "messages": messages }));
    part.media_type = HISTORY_MEDIA_TYPE.into();
    part
}

fn summary_fields(data: &Value) -> Value {
    match data {
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .filter(|(name, _)| SUMMARY_FIELDS.contains(&name.as_str()))
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect(),
        ),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::payload::PayloadValidator;
    use crate::protocol::PartContent;

    fn payload(context: Value) -> (Value, HandoffPayload) {
        let data = json!({
            "handoffId": "hf_1", "from": "triage", "to": "billing",
            "reason": "specialization", "goal": "Refund the duplicate charge",
            "summary": "Charged twice in March", "keyFacts": {"invoice": "INV-1"},
            "entities": {"customer": "c-7"}, "decisions": [{"id": "d1", "text": "refund", "reason": "dup", "locked": true}],
            "context": context,
        });
        let parsed = PayloadValidator::shared().validate(&data).expect("valid");
        (data, parsed)
    }

    fn history(n: usize) -> Vec<Message> {
        (0..n)
            .map(|i| {
                let mut message = Message::agent(vec![Part::text(format!("m{i}"))]);
                message.message_id = format!("m{i}");
                message
            })
            .collect()
    }

    fn data_of(part: &Part) -> &Value {
        match &part.content {
            PartContent::Data(data) => data,
            other => panic!("not data: {other:?}"),
        }
    }

    #[test]
    fn structured_sends_the_payload_alone() {
        let (data, parsed) = payload(json!({"policy": "STRUCTURED"}));
        let parts = transfer_parts(&data, &parsed, &history(3));
        assert_eq!(parts.len(), 1);
        assert_eq!(data_of(&parts[0]), &data);
        assert_eq!(parts[0].media_type, HANDOFF_MEDIA_TYPE);
    }

    #[test]
    fn summary_sends_goal_summary_and_key_facts_only() {
        let (data, parsed) = payload(json!({"policy": "SUMMARY"}));
        let parts = transfer_parts(&data, &parsed, &history(3));
        assert_eq!(parts.len(), 2);
        assert_eq!(
            parts[0].as_text(),
            Some("Refund the duplicate charge\n\nCharged twice in March")
        );
        let cut = data_of(&parts[1]);
        assert_eq!(cut["keyFacts"], json!({"invoice": "INV-1"}));
        assert!(cut.get("entities").is_none());
        assert!(cut.get("decisions").is_none());
    }

    #[test]
    fn full_and_last_n_carry_history() {
        let (data, parsed) = payload(json!({"policy": "FULL"}));
        let parts = transfer_parts(&data, &parsed, &history(4));
        assert_eq!(data_of(&parts[1])["messages"].as_array().unwrap().len(), 4);
        assert_eq!(parts[1].media_type, HISTORY_MEDIA_TYPE);

        let (data, parsed) = payload(json!({"policy": "LAST_N", "lastN": 2}));
        let parts = transfer_parts(&data, &parsed, &history(4));
        let messages = data_of(&parts[1])["messages"].as_array().unwrap().clone();
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0]["messageId"], "m2");
    }

    #[test]
    fn sizes_differ_by_policy() {
        let size = |context: Value| {
            let (data, parsed) = payload(context);
            let message = Message::user(transfer_parts(&data, &parsed, &history(20)));
            message_bytes(&message)
        };
        assert!(size(json!({"policy": "FULL"})) > size(json!({"policy": "LAST_N", "lastN": 2})));
        assert!(size(json!({"policy": "STRUCTURED"})) > size(json!({"policy": "SUMMARY"})));
    }

    #[test]
    fn direct_history_follows_the_policy() {
        assert!(direct_history(ContextPolicy::Summary, &history(2)).is_none());
        assert!(direct_history(ContextPolicy::Structured, &history(2)).is_none());
        assert!(direct_history(ContextPolicy::Full, &[]).is_none());
        let part = direct_history(ContextPolicy::LastN(1), &history(3)).unwrap();
        assert_eq!(data_of(&part)["messages"][0]["messageId"], "m2");
    }

    #[test]
    fn results_carry_artifact_parts_and_the_result_part() {
        let artifact = Artifact {
            artifact_id: "a1".into(),
            name: "refund".into(),
            parts: vec![Part::data(json!({"refundId": "rf_1"}))],
            ..Artifact::default()
        };
        let parts = result_parts("hf_1", "billing", TaskState::Completed, &[artifact]);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[1].media_type, HANDOFF_RESULT_MEDIA_TYPE);
        let result = data_of(&parts[1]);
        assert_eq!(result["from"], "billing");
        assert_eq!(result["status"], "TASK_STATE_COMPLETED");
        assert_eq!(result["artifacts"][0]["name"], "refund");
    }
}
