//! The handoff payload (DESIGN.md §3.2) and the status part (§3.4).
//!
//! A handoff travels as a `data` part of mediaType [`HANDOFF_MEDIA_TYPE`]; its
//! data is validated against `schemas/handoff.v1.schema.json`, compiled once
//! into the shared [`PayloadValidator`], and then read into a typed
//! [`HandoffPayload`].
//!
//! Validation policy:
//! - Every failing field is reported, each as a [`Violation`] whose pointer is
//!   relative to the payload object (`/decisions/0/reason`); a missing field is
//!   named by the pointer it would have, and data that is not an object at all
//!   is reported at `""`. The gateway answers such a payload with a REJECTED
//!   task whose status part ([`status_part`], reason
//!   [`SCHEMA_INVALID`](super::reasons::SCHEMA_INVALID))
//!   carries `detail.violations`.
//! - Exactly one of `to` and `toSkill`: with neither, the violation names
//!   `/to`; with both, it names `/toSkill`.
//! - Unknown fields are allowed and ignored (forward compatibility); the
//!   typed payload drops them, so forward the part as received, not
//!   re-serialised.
//! - Integers accept `1.0` (protobuf SDKs send every number as a double):
//!   2020-12 `integer` already does, and the typed fields read such numbers.
//! - `null` is not "not set" here, unlike in agent cards: the payload is plain
//!   JSON, and the published schema says the same to every other validator.

use crate::error::FieldViolation;
use crate::protocol::{Message, Part, PartContent, wire};
use crate::schema_support::{
    compile_embedded, describe_common, escape, oneof_members, serde_pointer,
};
use jsonschema::error::ValidationErrorKind;
use jsonschema::{ValidationError, Validator};
use serde::{Deserialize, Deserializer, Serialize, de};
use serde_json::{Map, Value, json};
use std::sync::LazyLock;

pub use super::reasons::{STATUS_MEDIA_TYPE, status_part};

/// The media type of a handoff payload part.
pub const HANDOFF_MEDIA_TYPE: &str = "application/vnd.baton.handoff.v1+json";
/// The media type of the result part delivered back with `returnToParent`.
pub const HANDOFF_RESULT_MEDIA_TYPE: &str = "application/vnd.baton.handoff-result.v1+json";
/// The schema text, embedded so that validation needs no file at run time.
const SCHEMA: &str = include_str!("../../schemas/handoff.v1.schema.json");

/// The process-wide validator, compiled on first use.
static SHARED: LazyLock<PayloadValidator> = LazyLock::new(PayloadValidator::new);

/// A typed handoff payload: the fields of DESIGN.md §3.2, camelCase on the
/// wire. Unknown fields are dropped.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HandoffPayload {
    /// Identifies this handoff; the result sent back carries it.
    pub handoff_id: String,
    /// Agent id of the sender.
    pub from: String,
    /// `to` or `toSkill`: exactly one is set.
    #[serde(flatten)]
    pub target: HandoffTarget,
    /// Why the sender hands off.
    pub reason: HandoffReason,
    /// What the target should achieve, in one sentence; never empty.
    pub goal: String,
    /// The conversation so far, summarised by the sender.
    pub summary: String,
    /// Facts established so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_facts: Option<Map<String, Value>>,
    /// Entities the conversation is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entities: Option<Map<String, Value>>,
    /// What the user asked for or prefers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_preferences: Option<Map<String, Value>>,
    /// The user's intent, in the sender's words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_intent: Option<String>,
    /// How far the work has come.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_progress: Option<TaskProgress>,
    /// Decisions taken so far.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<Decision>,
    /// Questions and tasks still open.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub open_items: Vec<OpenItem>,
    /// Artifacts the target needs, by reference.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<ArtifactRef>,
    /// Limits the target must respect.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub constraints: Vec<String>,
    /// How the sender will judge the result.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub success_criteria: Vec<String>,
    /// A JSON Schema the target's result must satisfy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_schema: Option<Map<String, Value>>,
    /// How much of the conversation the target receives.
    #[serde(default, skip_serializing_if = "ContextPolicy::is_default")]
    pub context: ContextPolicy,
    /// Deliver the target's result back to the sender when it is done.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub return_to_parent: bool,
}

/// Where a handoff goes: `to` (an agent id) or `toSkill` (a skill id).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HandoffTarget {
    /// `to`: this agent.
    #[serde(rename = "to")]
    Agent(String),
    /// `toSkill`: a healthy agent declaring this skill.
    #[serde(rename = "toSkill")]
    Skill(String),
}

impl HandoffTarget {
    /// The agent id or skill id.
    pub fn id(&self) -> &str {
        match self {
            Self::Agent(id) | Self::Skill(id) => id,
        }
    }
}

/// Why the sender hands off (`reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HandoffReason {
    /// `capability_boundary`: the sender cannot do what is asked.
    CapabilityBoundary,
    /// `specialization`: another agent does it better.
    Specialization,
    /// `escalation`: a human or a more capable agent must decide.
    Escalation,
    /// `load_balancing`: the sender is busy.
    LoadBalancing,
}

impl HandoffReason {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CapabilityBoundary => "capability_boundary",
            Self::Specialization => "specialization",
            Self::Escalation => "escalation",
            Self::LoadBalancing => "load_balancing",
        }
    }
}

/// `taskProgress`: how far the work has come.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskProgress {
    /// Steps done (0 before the first).
    #[serde(default, deserialize_with = "optional_count")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<u32>,
    /// Steps in all; at least 1.
    #[serde(default, deserialize_with = "optional_count")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total: Option<u32>,
    /// The steps done, described.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub completed: Vec<String>,
}

/// One of `decisions`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Decision {
    /// Identifies the decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// What was decided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Why; required, so that the target can judge whether it still holds.
    pub reason: String,
    /// A locked decision must not be revisited.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub locked: bool,
}

/// One of `openItems`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OpenItem {
    /// Identifies the item.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// What is open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// What it affects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub impact: Option<String>,
    /// The sender's suggestion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suggestion: Option<String>,
}

/// One of `artifacts`: a reference, not the content.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactRef {
    /// Where the artifact is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uri: Option<String>,
    /// SHA-256 of its content: 64 hexadecimal characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// What the target needs it for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub purpose: Option<String>,
}

/// `context`: how much of the conversation the target receives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "ContextWire", into = "ContextWire")]
pub enum ContextPolicy {
    /// `FULL`: the whole conversation.
    Full,
    /// `LAST_N` with `lastN`: the last n messages.
    LastN(u32),
    /// `SUMMARY` (the default): the payload's summary only.
    #[default]
    Summary,
    /// `STRUCTURED`: the payload's structured fields only.
    Structured,
}

impl ContextPolicy {
    /// Whether this is the default, [`ContextPolicy::Summary`].
    pub fn is_default(&self) -> bool {
        *self == Self::Summary
    }
}

/// `context` as written: `{policy, lastN}`.
#[derive(Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ContextWire {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    policy: Option<PolicyName>,
    #[serde(default, deserialize_with = "optional_count")]
    #[serde(skip_serializing_if = "Option::is_none")]
    last_n: Option<u32>,
}

/// The values of `context.policy`.
#[derive(Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
enum PolicyName {
    Full,
    LastN,
    Summary,
    Structured,
}

impl From<ContextWire> for ContextPolicy {
    fn from(wire: ContextWire) -> Self {
        match wire.policy {
            Some(PolicyName::Full) => Self::Full,
            // The schema requires lastN with LAST_N; 1 only if it was skipped.
            Some(PolicyName::LastN) => Self::LastN(wire.last_n.unwrap_or(1)),
            Some(PolicyName::Summary) | None => Self::Summary,
            Some(PolicyName::Structured) => Self::Structured,
        }
    }
}

impl From<ContextPolicy> for ContextWire {
    fn from(policy: ContextPolicy) -> Self {
        let (policy, last_n) = match policy {
            ContextPolicy::Full => (PolicyName::Full, None),
            ContextPolicy::LastN(n) => (PolicyName::LastN, Some(n)),
            ContextPolicy::Summary => (PolicyName::Summary, None),
            ContextPolicy::Structured => (PolicyName::Structured, None),
        };
        Self {
            policy: Some(policy),
            last_n,
        }
    }
}

/// Reads an optional count leniently, as ProtoJSON reads an int32 (`1.0`
/// is 1); the schema has already ruled out negative numbers.
fn optional_count<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u32>, D::Error> {
    wire::opt_int32::deserialize(deserializer)?
        .map(|n| u32::try_from(n).map_err(|_| de::Error::custom(format!("{n} is negative"))))
        .transpose()
}

/// One way a payload fails the schema.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Violation {
    /// JSON Pointer into the payload (`/decisions/0/reason`); `""` for the
    /// payload itself.
    pub pointer: String,
    /// What is wrong, e.g. `is required`.
    pub message: String,
}

impl Violation {
    /// A violation at `pointer`.
    pub fn new(pointer: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            pointer: pointer.into(),
            message: message.into(),
        }
    }
}

impl From<Violation> for FieldViolation {
    fn from(violation: Violation) -> Self {
        FieldViolation::new(violation.pointer, violation.message)
    }
}

/// The compiled handoff payload schema.
pub struct PayloadValidator {
    /// The schema document: `oneOf` errors look up their member names in it.
    schema: Value,
    validator: Validator,
}

impl std::fmt::Debug for PayloadValidator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadValidator").finish_non_exhaustive()
    }
}

impl Default for PayloadValidator {
    fn default() -> Self {
        Self::new()
    }
}

impl PayloadValidator {
    /// Compiles the embedded schema.
    ///
    /// # Panics
    ///
    /// Only if the embedded schema is not a valid 2020-12 schema, which the
    /// unit tests rule out.
    pub fn new() -> Self {
        let (schema, validator) = compile_embedded(SCHEMA, "handoff payload");
        Self { schema, validator }
    }

    /// The shared instance, compiled once per process.
    pub fn shared() -> &'static Self {
        &SHARED
    }

    /// Validates the data of a handoff part and, if it is valid, reads it.
    ///
    /// On failure, returns every violation, sorted by pointer.
    pub fn validate(&self, data: &Value) -> Result<HandoffPayload, Vec<Violation>> {
        let mut violations: Vec<Violation> = self
            .validator
            .iter_errors(data)
            .map(|error| self.violation(&error))
            .collect();
        if violations.is_empty() {
            // The schema is stricter than the serde types, so this only fails
            // if the two disagree (or a count overflows); report, not panic.
            let payload: HandoffPayload =
                serde_path_to_error::deserialize(data).map_err(|err| {
                    vec![Violation::new(
                        serde_pointer(err.path()),
                        err.inner().to_string(),
                    )]
                })?;
            // A result is checked against it only once the target's work is
            // done: a schema that cannot check anything is refused now.
            if let Some(schema) = &payload.return_schema {
                let schema = Value::Object(schema.clone());
                if let Err(reason) = crate::schema_support::check_result_schema(&schema) {
                    return Err(vec![Violation::new("/returnSchema", reason)]);
                }
            }
            return Ok(payload);
        }
        violations.sort();
        violations.dedup();
        Err(violations)
    }

    /// The violation one schema error stands for.
    fn violation(&self, error: &ValidationError<'_>) -> Violation {
        let pointer = error.instance_path().as_str();
        let instance: &Value = error.instance();
        if let Some(message) = describe_common(error) {
            return Violation::new(pointer, message);
        }
        match error.kind() {
            ValidationErrorKind::Required { property } => {
                let property = property.as_str().unwrap_or_default();
                let message = if property == "lastN" {
                    "is required with policy LAST_N"
                } else {
                    "is required"
                };
                Violation::new(format!("{pointer}/{}", escape(property)), message)
            }
            ValidationErrorKind::OneOfMultipleValid { .. }
            | ValidationErrorKind::OneOfNotValid { .. } => {
                self.oneof_violation(pointer, instance, error.schema_path().as_str())
            }
            ValidationErrorKind::Minimum { limit } => {
                Violation::new(pointer, format!("must be at least {limit}"))
            }
            ValidationErrorKind::Pattern { .. } if pointer.ends_with("/sha256") => {
                Violation::new(pointer, "must be 64 hexadecimal characters")
            }
            // Not produced by this schema today; jsonschema's own wording.
            _ => Violation::new(pointer, error.to_string()),
        }
    }

    /// The `to`/`toSkill` rule broken: each `oneOf` branch of the schema is
    /// `{"required": [member]}`. With none set, the first member is named as
    /// missing; with several, the second one set is named.
    fn oneof_violation(&self, pointer: &str, instance: &Value, schema_path: &str) -> Violation {
        let members = oneof_members(&self.schema, schema_path);
        let all = members.join(", ");
        let set: Vec<&str> = members
            .iter()
            .copied()
            .filter(|member| instance.get(member).is_some())
            .collect();
        match (set.first(), set.get(1)) {
            (Some(first), Some(second)) => Violation::new(
                format!("{pointer}/{}", escape(second)),
                format!("must not be set together with {first}; set exactly one of {all}"),
            ),
            _ => Violation::new(
                format!(
                    "{pointer}/{}",
                    escape(members.first().copied().unwrap_or_default())
                ),
                format!("is required: set exactly one of {all}"),
            ),
        }
    }
}

/// The data of the first `data` part of `message` whose mediaType is
/// [`HANDOFF_MEDIA_TYPE`], if any.
pub fn find_payload(message: &Message) -> Option<&Value> {
    find_data(&message.parts, HANDOFF_MEDIA_TYPE)
}

/// The data of the first `data` part among `parts` (a message's or an
/// artifact's) whose mediaType is `media_type`. Media types compare without
/// regard to case or parameters (`; charset=utf-8`); parts of that type that
/// carry text, bytes or a URL are skipped.
pub fn find_data<'p>(parts: &'p [Part], media_type: &str) -> Option<&'p Value> {
    parts.iter().find_map(|part| match &part.content {
        PartContent::Data(data) if same_media_type(&part.media_type, media_type) => Some(data),
        _ => None,
    })
}

/// Whether `given` names `expected`, ignoring case and parameters.
fn same_media_type(given: &str, expected: &str) -> bool {
    let essence = given.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case(expected)
}

/// The detail of `SCHEMA_INVALID` and `OUTPUT_SCHEMA_INVALID`:
/// `{"violations": [{pointer, message}]}`.
pub fn violations_detail(violations: &[Violation]) -> Value {
    json!({ "violations": violations })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::reasons::{HOP_LIMIT_EXCEEDED, SCHEMA_INVALID};

    fn minimal() -> Value {
        json!({
            "handoffId": "h-1",
            "from": "triage",
            "to": "billing",
            "reason": "specialization",
            "goal": "Refund the duplicate charge on invoice 42.",
            "summary": "The user was charged twice."
        })
    }

    fn full() -> Value {
        json!({
            "handoffId": "h-2",
            "from": "triage",
            "toSkill": "refunds",
            "reason": "capability_boundary",
            "goal": "Refund the duplicate charge on invoice 42.",
            "summary": "The user was charged twice for one order.",
            "keyFacts": {"invoice": 42, "amount": "19.99 EUR"},
            "entities": {"customer": {"id": "c-7"}},
            "userPreferences": {"language": "de"},
            "userIntent": "get my money back",
            "taskProgress": {"step": 2, "total": 4, "completed": ["identify", "verify"]},
            "decisions": [
                {"id": "d1", "text": "Refund, not credit", "reason": "user asked", "locked": true},
                {"reason": "policy"}
            ],
            "openItems": [
                {"id": "o1", "text": "Which card?", "impact": "refund target", "suggestion": "ask"}
            ],
            "artifacts": [{
                "uri": "https://files.example.com/invoice-42.pdf",
                "sha256": "9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08",
                "purpose": "the invoice"
            }],
            "constraints": ["no refunds above 100 EUR"],
            "successCriteria": ["refund issued"],
            "returnSchema": {"type": "object", "required": ["refundId"]},
            "context": {"policy": "LAST_N", "lastN": 5},
            "returnToParent": true,
            "futureField": {"ignored": true}
        })
    }

    /// `minimal()` with `edit` applied.
    fn with(edit: impl FnOnce(&mut Value)) -> Value {
        let mut payload = minimal();
        edit(&mut payload);
        payload
    }

    fn remove(payload: &mut Value, key: &str) {
        payload.as_object_mut().unwrap().remove(key).unwrap();
    }

    fn pointers(payload: &Value) -> Vec<String> {
        match PayloadValidator::shared().validate(payload) {
            Ok(_) => Vec::new(),
            Err(violations) => violations.into_iter().map(|v| v.pointer).collect(),
        }
    }

    #[test]
    fn the_embedded_schema_compiles() {
        let schema: Value = serde_json::from_str(SCHEMA).unwrap();
        jsonschema::meta::validate(&schema).unwrap();
        PayloadValidator::new();
    }

    #[test]
    fn a_minimal_payload_passes_with_defaults() {
        let payload = PayloadValidator::shared().validate(&minimal()).unwrap();
        assert_eq!(payload.handoff_id, "h-1");
        assert_eq!(payload.target, HandoffTarget::Agent("billing".into()));
        assert_eq!(payload.target.id(), "billing");
        assert_eq!(payload.reason, HandoffReason::Specialization);
        assert_eq!(payload.context, ContextPolicy::Summary);
        assert!(!payload.return_to_parent);
        assert!(payload.decisions.is_empty() && payload.task_progress.is_none());
        // Serialising writes back what was given.
        assert_eq!(serde_json::to_value(&payload).unwrap(), minimal());
    }

    #[test]
    fn a_return_schema_that_is_no_json_schema_is_refused_up_front() {
        for schema in [
            json!({"type": 12}),
            json!({"type": "object", "properties": {"amount": {"minimum": "zero"}}}),
        ] {
            let mut payload = minimal();
            payload["returnSchema"] = schema.clone();
            let violations = PayloadValidator::shared().validate(&payload).unwrap_err();
            assert_eq!(violations.len(), 1, "{schema}: {violations:?}");
            assert_eq!(violations[0].pointer, "/returnSchema", "{schema}");
            assert!(
                violations[0].message.contains("JSON Schema"),
                "{violations:?}"
            );
        }
        let mut payload = minimal();
        payload["returnSchema"] = json!({"type": "object", "required": ["refundId"]});
        assert!(PayloadValidator::shared().validate(&payload).is_ok());
    }

    #[test]
    fn a_full_payload_passes_and_parses() {
        let payload = PayloadValidator::shared().validate(&full()).unwrap();
        assert_eq!(payload.target, HandoffTarget::Skill("refunds".into()));
        assert_eq!(payload.reason, HandoffReason::CapabilityBoundary);
        assert_eq!(payload.key_facts.as_ref().unwrap()["invoice"], 42);
        assert_eq!(payload.user_intent.as_deref(), Some("get my money back"));
        let progress = payload.task_progress.as_ref().unwrap();
        assert_eq!((progress.step, progress.total), (Some(2), Some(4)));
        assert_eq!(progress.completed, ["identify", "verify"]);
        assert!(payload.decisions[0].locked);
        assert_eq!(payload.decisions[1].reason, "policy");
        assert!(!payload.decisions[1].locked);
        assert_eq!(payload.open_items[0].suggestion.as_deref(), Some("ask"));
        assert_eq!(payload.artifacts[0].purpose.as_deref(), Some("the invoice"));
        assert_eq!(payload.constraints.len(), 1);
        assert_eq!(payload.success_criteria, ["refund issued"]);
        assert_eq!(payload.return_schema.as_ref().unwrap()["type"], "object");
        assert_eq!(payload.context, ContextPolicy::LastN(5));
        assert!(payload.return_to_parent);
        // Round trip: everything but the unknown field comes back.
        let mut expected = full();
        remove(&mut expected, "futureField");
        assert_eq!(serde_json::to_value(&payload).unwrap(), expected);
    }

    #[test]
    fn every_context_policy_parses() {
        for (context, expected) in [
            (json!({}), ContextPolicy::Summary),
            (json!({"policy": "FULL"}), ContextPolicy::Full),
            (
                json!({"policy": "SUMMARY", "lastN": 3}),
                ContextPolicy::Summary,
            ),
            (json!({"policy": "STRUCTURED"}), ContextPolicy::Structured),
            (
                json!({"policy": "LAST_N", "lastN": 1}),
                ContextPolicy::LastN(1),
            ),
        ] {
            let payload = with(|p| p["context"] = context.clone());
            let parsed = PayloadValidator::shared().validate(&payload).unwrap();
            assert_eq!(parsed.context, expected, "{context}");
        }
    }

    #[test]
    fn integers_accept_doubles_with_no_fraction() {
        let payload = with(|p| {
            p["taskProgress"] = json!({"step": 0.0, "total": 1.0});
            p["context"] = json!({"policy": "LAST_N", "lastN": 3.0});
        });
        let parsed = PayloadValidator::shared().validate(&payload).unwrap();
        let progress = parsed.task_progress.unwrap();
        assert_eq!((progress.step, progress.total), (Some(0), Some(1)));
        assert_eq!(parsed.context, ContextPolicy::LastN(3));
        // A fraction is still not an integer.
        let half = with(|p| p["taskProgress"] = json!({"step": 1.5}));
        let violations = PayloadValidator::shared().validate(&half).unwrap_err();
        assert_eq!(
            violations,
            [Violation::new(
                "/taskProgress/step",
                "must be an integer, not a number"
            )]
        );
    }

    #[test]
    fn an_integer_too_large_for_its_field_is_a_violation() {
        let payload = with(|p| p["context"] = json!({"policy": "LAST_N", "lastN": 5e9}));
        assert_eq!(pointers(&payload), ["/context/lastN"]);
    }

    #[test]
    fn invalid_payloads_name_the_failing_fields() {
        type Edit = Box<dyn FnOnce(&mut Value)>;
        let cases: Vec<(&str, Edit, Vec<&str>)> = vec![
            (
                "no handoffId",
                Box::new(|p| remove(p, "handoffId")),
                vec!["/handoffId"],
            ),
            ("no from", Box::new(|p| remove(p, "from")), vec!["/from"]),
            ("no goal", Box::new(|p| remove(p, "goal")), vec!["/goal"]),
            (
                "no summary",
                Box::new(|p| remove(p, "summary")),
                vec!["/summary"],
            ),
            (
                "no reason",
                Box::new(|p| remove(p, "reason")),
                vec!["/reason"],
            ),
            (
                "to and toSkill",
                Box::new(|p| p["toSkill"] = json!("refunds")),
                vec!["/toSkill"],
            ),
            (
                "neither to nor toSkill",
                Box::new(|p| remove(p, "to")),
                vec!["/to"],
            ),
            (
                "unknown reason",
                Box::new(|p| p["reason"] = json!("boredom")),
                vec!["/reason"],
            ),
            (
                "empty goal",
                Box::new(|p| p["goal"] = json!("")),
                vec!["/goal"],
            ),
            (
                "from not a string",
                Box::new(|p| p["from"] = json!(7)),
                vec!["/from"],
            ),
            (
                "toSkill null",
                Box::new(|p| {
                    remove(p, "to");
                    p["toSkill"] = Value::Null;
                }),
                vec!["/toSkill"],
            ),
            (
                "step -1",
                Box::new(|p| p["taskProgress"] = json!({"step": -1, "total": 3})),
                vec!["/taskProgress/step"],
            ),
            (
                "total 0",
                Box::new(|p| p["taskProgress"] = json!({"step": 0, "total": 0})),
                vec!["/taskProgress/total"],
            ),
            (
                "completed not strings",
                Box::new(|p| p["taskProgress"] = json!({"completed": ["a", 2]})),
                vec!["/taskProgress/completed/1"],
            ),
            (
                "decision without reason",
                Box::new(|p| p["decisions"] = json!([{"id": "d1", "text": "t", "locked": false}])),
                vec!["/decisions/0/reason"],
            ),
            (
                "decision locked not a boolean",
                Box::new(|p| {
                    p["decisions"] = json!([{"reason": "r"}, {"reason": "r", "locked": "yes"}])
                }),
                vec!["/decisions/1/locked"],
            ),
            (
                "open item impact not a string",
                Box::new(|p| p["openItems"] = json!([{"impact": 3}])),
                vec!["/openItems/0/impact"],
            ),
            (
                "sha256 too short",
                Box::new(|p| p["artifacts"] = json!([{"uri": "u", "sha256": "abc123"}])),
                vec!["/artifacts/0/sha256"],
            ),
            (
                "sha256 not hex",
                Box::new(|p| p["artifacts"] = json!([{"sha256": "g".repeat(64)}])),
                vec!["/artifacts/0/sha256"],
            ),
            (
                "keyFacts not an object",
                Box::new(|p| p["keyFacts"] = json!(["a"])),
                vec!["/keyFacts"],
            ),
            (
                "constraints not strings",
                Box::new(|p| p["constraints"] = json!("be quick")),
                vec!["/constraints"],
            ),
            (
                "returnSchema not an object",
                Box::new(|p| p["returnSchema"] = json!(true)),
                vec!["/returnSchema"],
            ),
            (
                "unknown context policy",
                Box::new(|p| p["context"] = json!({"policy": "EVERYTHING"})),
                vec!["/context/policy"],
            ),
            (
                "lastN 0",
                Box::new(|p| p["context"] = json!({"policy": "LAST_N", "lastN": 0})),
                vec!["/context/lastN"],
            ),
            (
                "LAST_N without lastN",
                Box::new(|p| p["context"] = json!({"policy": "LAST_N"})),
                vec!["/context/lastN"],
            ),
            (
                "returnToParent \"yes\"",
                Box::new(|p| p["returnToParent"] = json!("yes")),
                vec!["/returnToParent"],
            ),
            (
                "not an object",
                Box::new(|p| *p = json!("hand off")),
                vec![""],
            ),
            ("an array", Box::new(|p| *p = json!([minimal()])), vec![""]),
            ("null", Box::new(|p| *p = Value::Null), vec![""]),
            (
                "everything missing",
                Box::new(|p| *p = json!({})),
                vec!["/from", "/goal", "/handoffId", "/reason", "/summary", "/to"],
            ),
        ];
        assert!(cases.len() >= 15);
        for (name, edit, expected) in cases {
            assert_eq!(pointers(&with(edit)), expected, "{name}");
        }
    }

    #[test]
    fn several_violations_are_reported_at_once_and_described() {
        let payload = with(|p| {
            remove(p, "summary");
            p["toSkill"] = json!("refunds");
            p["reason"] = json!("boredom");
            p["goal"] = json!("");
            p["taskProgress"] = json!({"step": -1, "total": 0});
            p["decisions"] = json!([{"text": "t"}]);
            p["artifacts"] = json!([{"sha256": "00"}]);
            p["context"] = json!({"policy": "LAST_N"});
            p["returnToParent"] = json!(1);
        });
        let violations = PayloadValidator::shared().validate(&payload).unwrap_err();
        let described: Vec<(&str, &str)> = violations
            .iter()
            .map(|v| (v.pointer.as_str(), v.message.as_str()))
            .collect();
        assert_eq!(
            described,
            [
                ("/artifacts/0/sha256", "must be 64 hexadecimal characters"),
                ("/context/lastN", "is required with policy LAST_N"),
                ("/decisions/0/reason", "is required"),
                ("/goal", "must not be empty"),
                (
                    "/reason",
                    "must be one of \"capability_boundary\", \"specialization\", \
                     \"escalation\", \"load_balancing\""
                ),
                ("/returnToParent", "must be a boolean, not an integer"),
                ("/summary", "is required"),
                ("/taskProgress/step", "must be at least 0"),
                ("/taskProgress/total", "must be at least 1"),
                (
                    "/toSkill",
                    "must not be set together with to; set exactly one of to, toSkill"
                ),
            ]
        );
        let neither = PayloadValidator::shared()
            .validate(&with(|p| remove(p, "to")))
            .unwrap_err();
        assert_eq!(
            neither,
            [Violation::new(
                "/to",
                "is required: set exactly one of to, toSkill"
            )]
        );
        let root = PayloadValidator::shared().validate(&json!(42)).unwrap_err();
        assert_eq!(
            root,
            [Violation::new("", "must be an object, not an integer")]
        );
    }

    #[test]
    fn violations_serialise_as_pointer_and_message() {
        let violation = Violation::new("/goal", "must not be empty");
        assert_eq!(
            serde_json::to_value(&violation).unwrap(),
            json!({"pointer": "/goal", "message": "must not be empty"})
        );
        let field: FieldViolation = violation.into();
        assert_eq!(field, FieldViolation::new("/goal", "must not be empty"));
    }

    #[test]
    fn status_part_carries_reason_and_detail() {
        let violations = vec![Violation::new("/goal", "must not be empty")];
        let part = status_part(SCHEMA_INVALID, violations_detail(&violations));
        assert_eq!(part.media_type, STATUS_MEDIA_TYPE);
        assert_eq!(
            serde_json::to_value(&part).unwrap(),
            json!({
                "data": {
                    "reason": "SCHEMA_INVALID",
                    "detail": {"violations": [{"pointer": "/goal", "message": "must not be empty"}]}
                },
                "mediaType": "application/vnd.baton.status.v1+json"
            })
        );
        let part = status_part(HOP_LIMIT_EXCEEDED, Value::Null);
        assert_eq!(
            part.content,
            PartContent::Data(json!({"reason": "HOP_LIMIT_EXCEEDED", "detail": {}}))
        );
    }

    #[test]
    fn find_payload_takes_the_first_handoff_data_part() {
        let mut text = Part::text("please hand off");
        text.media_type = HANDOFF_MEDIA_TYPE.to_owned();
        let mut other = Part::data(json!({"other": true}));
        other.media_type = "application/json".to_owned();
        let mut first = Part::data(json!({"n": 1}));
        first.media_type = "Application/VND.Baton.Handoff.v1+JSON; charset=utf-8".to_owned();
        let mut second = Part::data(json!({"n": 2}));
        second.media_type = HANDOFF_MEDIA_TYPE.to_owned();
        let mut message: Message = serde_json::from_value(json!({
            "messageId": "m", "role": "ROLE_USER", "parts": [{"text": "hi"}]
        }))
        .unwrap();
        assert_eq!(find_payload(&message), None);
        message.parts = vec![text, other, first, second];
        assert_eq!(find_payload(&message), Some(&json!({"n": 1})));
        assert_eq!(
            find_data(&message.parts, "application/json"),
            Some(&json!({"other": true}))
        );
    }
}
