//! Reason codes of the gateway task's lifecycle (DESIGN.md §3.4), carried in
//! a status message part of media type [`STATUS_MEDIA_TYPE`].

use crate::protocol::Part;
use serde_json::{Value, json};

/// The media type of the status part: `{"reason": …, "detail": {…}}`.
pub const STATUS_MEDIA_TYPE: &str = "application/vnd.baton.status.v1+json";

/// Reason: the payload fails the schema (REJECTED, `detail.violations`).
pub const SCHEMA_INVALID: &str = "SCHEMA_INVALID";
/// Reason: `hops >= maxHops` (REJECTED).
pub const HOP_LIMIT_EXCEEDED: &str = "HOP_LIMIT_EXCEEDED";
/// Reason: the target is already in `chain` (REJECTED).
pub const HANDOFF_CYCLE: &str = "HANDOFF_CYCLE";
/// Reason: `to` is unknown, or no agent has `toSkill` (REJECTED).
pub const TARGET_NOT_FOUND: &str = "TARGET_NOT_FOUND";
/// Reason: the source is not on the target's allow list (REJECTED).
pub const NOT_ALLOWED: &str = "NOT_ALLOWED";
/// Reason: no acknowledgement, retrying the same agent (still SUBMITTED).
pub const RETRY: &str = "RETRY";
/// Reason: no acknowledgement, trying another agent with the skill (still SUBMITTED).
pub const REROUTED: &str = "REROUTED";
/// Reason: ladder exhausted, escalation configured (INPUT_REQUIRED).
pub const ESCALATED: &str = "ESCALATED";
/// Reason: ladder exhausted, no escalation (FAILED).
pub const TARGET_UNAVAILABLE: &str = "TARGET_UNAVAILABLE";
/// Reason: the artifacts fail `returnSchema` or the skill's output schema
/// (FAILED, `detail.violations`).
pub const OUTPUT_SCHEMA_INVALID: &str = "OUTPUT_SCHEMA_INVALID";
/// Reason: the deadline passed (FAILED).
pub const DEADLINE_EXCEEDED: &str = "DEADLINE_EXCEEDED";
/// Reason: the agent reported more events than one task may hold (FAILED,
/// `detail.limit`; not in DESIGN.md §3.4, see the README's design notes).
pub const EVENT_LIMIT_EXCEEDED: &str = "EVENT_LIMIT_EXCEEDED";
/// Reason: the agent reported more than one task's record may hold (FAILED,
/// `detail.limitBytes`; not in DESIGN.md §3.4, see the README's design notes).
pub const TASK_SIZE_EXCEEDED: &str = "TASK_SIZE_EXCEEDED";
/// Reason: the agent holding the task could not be reached (FAILED,
/// `detail.agent`). This and the next four are not in DESIGN.md §3.4: an
/// agent's fault ends the task. The first three are also the `ErrorInfo`
/// reasons of the same fault before a task exists (`GatewayError`).
pub const UPSTREAM_UNREACHABLE: &str = "UPSTREAM_UNREACHABLE";
/// Reason: the agent holding the task did not answer in time (FAILED).
pub const UPSTREAM_TIMEOUT: &str = "UPSTREAM_TIMEOUT";
/// Reason: the agent answered with something that is not a valid A2A
/// reply (FAILED).
pub const INVALID_AGENT_RESPONSE: &str = "INVALID_AGENT_RESPONSE";
/// Reason: the agent answered a call about the task with a JSON-RPC error
/// (FAILED, `detail.code`), such as -32001 for a task it no longer knows.
pub const UPSTREAM_ERROR: &str = "UPSTREAM_ERROR";
/// Reason: the agent failed otherwise, or cannot take its task up again
/// after a restart (a built-in agent's work is not kept) (FAILED).
pub const AGENT_FAILED: &str = "AGENT_FAILED";

/// The status part of DESIGN.md §3.4: a `data` part of mediaType
/// [`STATUS_MEDIA_TYPE`], `{"reason": reason, "detail": detail}`. A `null`
/// detail is written as `{}`.
pub fn status_part(reason: &str, detail: Value) -> Part {
    let detail = if detail.is_null() { json!({}) } else { detail };
    let mut part = Part::data(json!({ "reason": reason, "detail": detail }));
    part.media_type = STATUS_MEDIA_TYPE.to_owned();
    part
}
