//! Validation of method params beyond what deserialization checks: required
//! fields, ranges and media types. Every violation is collected, so one reply
//! names every failing field.

use crate::error::{FieldViolation, GatewayError};
use crate::protocol::{AgentCard, Message, Part, PartContent, Role};

/// Largest `pageSize` ListTasks accepts.
pub const MAX_PAGE_SIZE: i32 = 100;
/// `pageSize` when the caller sets none.
pub const DEFAULT_PAGE_SIZE: i32 = 50;

/// Deepest nesting of a message's `data` or `metadata` values Baton takes.
/// Replies nest what they carry up to seven levels deeper than a request
/// does (`result.task.history[].parts[].data`), and serde-based clients stop
/// at 128 levels, so this leaves every reply readable.
pub const MAX_VALUE_DEPTH: usize = 100;

/// Checks a message sent by a client.
pub fn check_message(message: &Message, path: &str, violations: &mut Vec<FieldViolation>) {
    if message.message_id.trim().is_empty() {
        violations.push(FieldViolation::new(
            format!("{path}.messageId"),
            "is required",
        ));
    }
    if message.role == Role::Unspecified {
        violations.push(FieldViolation::new(
            format!("{path}.role"),
            "is required (ROLE_USER or ROLE_AGENT)",
        ));
    }
    if message.parts.is_empty() {
        violations.push(FieldViolation::new(
            format!("{path}.parts"),
            "must contain at least one part",
        ));
    }
    for (i, part) in message.parts.iter().enumerate() {
        check_part(part, path, i, violations);
    }
    if let Some(metadata) = &message.metadata {
        check_depth(
            object_depth(metadata),
            || format!("{path}.metadata"),
            violations,
        );
    }
}

/// Checks that a `data` or `metadata` value nesting `depth` levels nests at
/// most [`MAX_VALUE_DEPTH`]; `path` is written only for a violation.
fn check_depth(depth: usize, path: impl FnOnce() -> String, violations: &mut Vec<FieldViolation>) {
    if depth > MAX_VALUE_DEPTH {
        violations.push(FieldViolation::new(
            path(),
            format!("nests deeper than {MAX_VALUE_DEPTH} levels"),
        ));
    }
}

/// Levels of nesting in `object`, itself one. Recursion is bounded by the
/// parser's own depth limit, which every request passed.
fn object_depth(object: &serde_json::Map<String, serde_json::Value>) -> usize {
    1 + object.values().map(value_depth).max().unwrap_or(0)
}

fn value_depth(value: &serde_json::Value) -> usize {
    match value {
        serde_json::Value::Object(object) => object_depth(object),
        serde_json::Value::Array(items) => 1 + items.iter().map(value_depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Checks `path.parts[index]`; the path is written only for a violation.
fn check_part(part: &Part, path: &str, index: usize, violations: &mut Vec<FieldViolation>) {
    if let PartContent::Url(url) = &part.content
        && url.trim().is_empty()
    {
        violations.push(FieldViolation::new(
            format!("{path}.parts[{index}].url"),
            "must not be empty",
        ));
    }
    if let PartContent::Data(data) = &part.content {
        let path = || format!("{path}.parts[{index}].data");
        check_depth(value_depth(data), path, violations);
    }
    if let Some(metadata) = &part.metadata {
        let path = || format!("{path}.parts[{index}].metadata");
        check_depth(object_depth(metadata), path, violations);
    }
}

/// Checks an optional `historyLength`.
pub fn check_history_length(value: Option<i32>, path: &str, violations: &mut Vec<FieldViolation>) {
    if let Some(n) = value
        && n < 0
    {
        violations.push(FieldViolation::new(
            path,
            format!("must be non-negative, got {n}"),
        ));
    }
}

/// Checks a required id field.
pub fn check_required(value: &str, path: &str, violations: &mut Vec<FieldViolation>) {
    if value.trim().is_empty() {
        violations.push(FieldViolation::new(path, "is required"));
    }
}

/// Turns collected violations into a result.
pub fn finish(violations: Vec<FieldViolation>) -> Result<(), GatewayError> {
    if violations.is_empty() {
        Ok(())
    } else {
        Err(GatewayError::invalid_fields(violations))
    }
}

/// True when `offered` (e.g. `text/plain`) is covered by `accepted`
/// (e.g. `text/plain`, `text/*` or `*/*`), ignoring parameters and case.
pub fn media_type_matches(accepted: &str, offered: &str) -> bool {
    // Compared without copies: this runs for every part of every send.
    fn essence(m: &str) -> &str {
        m.split(';').next().unwrap_or("").trim()
    }
    let (accepted, offered) = (essence(accepted), essence(offered));
    if accepted == "*/*" || accepted == "*" || accepted.eq_ignore_ascii_case(offered) {
        return true;
    }
    match (accepted.split_once('/'), offered.split_once('/')) {
        (Some((a_type, "*")), Some((o_type, _))) => a_type.eq_ignore_ascii_case(o_type),
        _ => false,
    }
}

/// The media types of the handoff extension's own parts, which Baton reads
/// and writes itself.
const BATON_MEDIA_TYPES: [&str; 4] = [
    crate::handoff::payload::HANDOFF_MEDIA_TYPE,
    crate::handoff::payload::HANDOFF_RESULT_MEDIA_TYPE,
    crate::handoff::reasons::STATUS_MEDIA_TYPE,
    crate::handoff::context::HISTORY_MEDIA_TYPE,
];

/// -32008 when the card requires an extension the caller did not activate.
pub fn check_required_extensions(
    card: &AgentCard,
    activated: &[String],
) -> Result<(), GatewayError> {
    match card
        .capabilities
        .extensions
        .iter()
        .find(|e| e.required && !activated.contains(&e.uri))
    {
        Some(missing) => Err(GatewayError::ExtensionSupportRequired(missing.uri.clone())),
        None => Ok(()),
    }
}

/// Checks that the agent accepts every declared media type in the message
/// (-32005 otherwise). Parts without a media type are accepted.
pub fn check_input_modes(card: &AgentCard, message: &Message) -> Result<(), GatewayError> {
    let mut accepted: Vec<&str> = card
        .default_input_modes
        .iter()
        .map(String::as_str)
        .collect();
    for skill in &card.skills {
        accepted.extend(skill.input_modes.iter().map(String::as_str));
    }
    if accepted.is_empty() {
        return Ok(());
    }
    for part in &message.parts {
        // Baton's own parts (handoff payloads and results) are the gateway's
        // to read, so every agent behind it takes them; any other label in
        // its namespace is the agent's to accept, like any media type.
        if part.media_type.is_empty()
            || BATON_MEDIA_TYPES
                .iter()
                .any(|own| media_type_matches(own, &part.media_type))
        {
            continue;
        }
        if !accepted
            .iter()
            .any(|a| media_type_matches(a, &part.media_type))
        {
            return Err(GatewayError::ContentTypeNotSupported(format!(
                "media type {:?} is not accepted by this agent (accepts {})",
                part.media_type,
                accepted.join(", ")
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_batons_own_parts_pass_every_agents_input_modes() {
        let card: AgentCard = serde_json::from_value(serde_json::json!({
            "name": "t", "description": "t", "version": "1",
            "supportedInterfaces": [], "capabilities": {},
            "defaultInputModes": ["text/plain"], "defaultOutputModes": ["text/plain"],
            "skills": [],
        }))
        .unwrap();
        let with = |media_type: &str| {
            let mut part = Part::data(serde_json::json!({}));
            part.media_type = media_type.to_string();
            Message::user(vec![part])
        };
        let handoff = crate::handoff::payload::HANDOFF_MEDIA_TYPE;
        assert!(check_input_modes(&card, &with(handoff)).is_ok());
        let label = "application/vnd.baton.anything+json";
        let refused = check_input_modes(&card, &with(label)).unwrap_err();
        assert!(
            matches!(refused, GatewayError::ContentTypeNotSupported(_)),
            "{refused:?}"
        );
    }

    #[test]
    fn media_types_match_with_wildcards_and_parameters() {
        assert!(media_type_matches(
            "text/plain",
            "text/plain; charset=utf-8"
        ));
        assert!(media_type_matches("text/*", "text/html"));
        assert!(media_type_matches("*/*", "image/png"));
        assert!(!media_type_matches("text/plain", "image/png"));
        assert!(!media_type_matches("text/*", "image/png"));
        assert!(media_type_matches(
            "Text/Plain",
            "text/plain; charset=utf-8"
        ));
        assert!(media_type_matches("image/*", "IMAGE/png"));
    }
}
