//! A2A 1.0 core objects (`a2a.proto`): tasks, messages, parts, artifacts and
//! the streaming events, in exact ProtoJSON.
//!
//! Every field accepts its snake_case proto name as an alias, and `null` as its
//! default. Defaults are omitted on output; proto3 `optional` fields are emitted
//! whenever they are set.

use super::wire::{self, ProtoEnum, Struct, nullable};
use chrono::{DateTime, Utc};
use serde::de::{self, Deserializer};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// `TaskState`: where a task is in its lifecycle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TaskState {
    /// Not set; never emitted.
    #[default]
    Unspecified,
    /// Accepted, not started.
    Submitted,
    /// Being worked on.
    Working,
    /// Finished successfully (terminal).
    Completed,
    /// Finished with an error (terminal).
    Failed,
    /// Canceled by the client (terminal).
    Canceled,
    /// Waiting for the client (interrupted).
    InputRequired,
    /// Refused by the agent (terminal).
    Rejected,
    /// Waiting for credentials (interrupted).
    AuthRequired,
}

impl TaskState {
    /// Terminal states can never change again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Completed | Self::Failed | Self::Canceled | Self::Rejected
        )
    }

    /// Interrupted states wait for something outside the agent.
    pub fn is_interrupted(self) -> bool {
        matches!(self, Self::InputRequired | Self::AuthRequired)
    }

    /// Settled states end an agent's turn: terminal or interrupted.
    pub fn is_settled(self) -> bool {
        self.is_terminal() || self.is_interrupted()
    }

    /// The proto number, used as a compact key in ledger indexes.
    pub fn number(self) -> u8 {
        Self::VALUES
            .iter()
            .find(|(v, _, _)| *v == self)
            .map(|(_, _, n)| *n as u8)
            .unwrap_or(0)
    }
}

impl ProtoEnum for TaskState {
    const TYPE_NAME: &'static str = "TaskState";
    const VALUES: &'static [(Self, &'static str, i32)] = &[
        (Self::Unspecified, "TASK_STATE_UNSPECIFIED", 0),
        (Self::Submitted, "TASK_STATE_SUBMITTED", 1),
        (Self::Working, "TASK_STATE_WORKING", 2),
        (Self::Completed, "TASK_STATE_COMPLETED", 3),
        (Self::Failed, "TASK_STATE_FAILED", 4),
        (Self::Canceled, "TASK_STATE_CANCELED", 5),
        (Self::InputRequired, "TASK_STATE_INPUT_REQUIRED", 6),
        (Self::Rejected, "TASK_STATE_REJECTED", 7),
        (Self::AuthRequired, "TASK_STATE_AUTH_REQUIRED", 8),
    ];

    fn from_alias(text: &str) -> Option<Self> {
        // v0.3 spellings, so older peers are understood.
        Some(match text {
            "submitted" => Self::Submitted,
            "working" => Self::Working,
            "completed" => Self::Completed,
            "failed" => Self::Failed,
            "canceled" | "cancelled" => Self::Canceled,
            "input-required" => Self::InputRequired,
            "rejected" => Self::Rejected,
            "auth-required" => Self::AuthRequired,
            _ => return None,
        })
    }
}

/// `Role`: who sent a message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Role {
    /// Not set.
    #[default]
    Unspecified,
    /// Client to agent.
    User,
    /// Agent to client.
    Agent,
}

impl ProtoEnum for Role {
    const TYPE_NAME: &'static str = "Role";
    const VALUES: &'static [(Self, &'static str, i32)] = &[
        (Self::Unspecified, "ROLE_UNSPECIFIED", 0),
        (Self::User, "ROLE_USER", 1),
        (Self::Agent, "ROLE_AGENT", 2),
    ];

    fn from_alias(text: &str) -> Option<Self> {
        match text {
            "user" => Some(Self::User),
            "agent" => Some(Self::Agent),
            _ => None,
        }
    }
}

macro_rules! proto_enum_serde {
    ($ty:ty) => {
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.proto_name())
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                wire::deserialize_enum(d)
            }
        }

        impl $ty {
            /// True for the zero value, which ProtoJSON omits.
            pub fn is_unspecified(&self) -> bool {
                *self == Self::default()
            }
        }
    };
}

proto_enum_serde!(TaskState);
proto_enum_serde!(Role);

/// The content of a [`Part`]: exactly one of the proto's `oneof content`.
#[derive(Clone, Debug, PartialEq)]
pub enum PartContent {
    /// `text`.
    Text(String),
    /// `raw`, base64 on the wire.
    Raw(Vec<u8>),
    /// `url`.
    Url(String),
    /// `data`: any JSON value.
    Data(serde_json::Value),
}

/// `Part`: one piece of content, flat on the wire.
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    /// The content.
    pub content: PartContent,
    /// Part metadata.
    pub metadata: Option<Struct>,
    /// An optional file name.
    pub filename: String,
    /// The media type, e.g. `text/plain`.
    pub media_type: String,
}

impl Part {
    /// A text part.
    pub fn text(text: impl Into<String>) -> Self {
        Self::from_content(PartContent::Text(text.into()))
    }

    /// A data part.
    pub fn data(data: serde_json::Value) -> Self {
        Self::from_content(PartContent::Data(data))
    }

    /// A part with no metadata, filename or media type.
    pub fn from_content(content: PartContent) -> Self {
        Self {
            content,
            metadata: None,
            filename: String::new(),
            media_type: String::new(),
        }
    }

    /// The text, if this is a text part.
    pub fn as_text(&self) -> Option<&str> {
        match &self.content {
            PartContent::Text(text) => Some(text),
            _ => None,
        }
    }
}

impl Serialize for Part {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        match &self.content {
            PartContent::Text(text) => map.serialize_entry("text", text)?,
            PartContent::Raw(raw) => map.serialize_entry("raw", &wire::encode_base64(raw))?,
            PartContent::Url(url) => map.serialize_entry("url", url)?,
            PartContent::Data(data) => map.serialize_entry("data", data)?,
        }
        if let Some(metadata) = &self.metadata {
            map.serialize_entry("metadata", metadata)?;
        }
        if !self.filename.is_empty() {
            map.serialize_entry("filename", &self.filename)?;
        }
        if !self.media_type.is_empty() {
            map.serialize_entry("mediaType", &self.media_type)?;
        }
        map.end()
    }
}

/// `Some` for a member that is present, JSON null included.
fn present_value<'de, D: Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

impl<'de> Deserialize<'de> for Part {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct PartWire {
            #[serde(default)]
            text: Option<String>,
            // Decoded where it is read, so an error names `raw`, not only the part.
            #[serde(default, deserialize_with = "wire::opt_bytes")]
            raw: Option<Vec<u8>>,
            #[serde(default)]
            url: Option<String>,
            // A `google.protobuf.Value`: JSON null is its null value, set.
            #[serde(default, deserialize_with = "present_value")]
            data: Option<serde_json::Value>,
            #[serde(default)]
            metadata: Option<Struct>,
            #[serde(default, deserialize_with = "nullable")]
            filename: String,
            #[serde(default, alias = "media_type", deserialize_with = "nullable")]
            media_type: String,
        }

        let wire = PartWire::deserialize(d)?;
        let mut contents = Vec::with_capacity(1);
        if let Some(text) = wire.text {
            contents.push(PartContent::Text(text));
        }
        if let Some(raw) = wire.raw {
            contents.push(PartContent::Raw(raw));
        }
        if let Some(url) = wire.url {
            contents.push(PartContent::Url(url));
        }
        if let Some(data) = wire.data {
            contents.push(PartContent::Data(data));
        }
        if contents.len() != 1 {
            return Err(de::Error::custom(format!(
                "a Part must set exactly one of text, raw, url, data (found {})",
                contents.len()
            )));
        }
        Ok(Part {
            content: contents.remove(0),
            metadata: wire.metadata,
            filename: wire.filename,
            media_type: wire.media_type,
        })
    }
}

/// `Message`: one turn of communication.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Message {
    /// Set by the sender; required.
    #[serde(default, alias = "message_id", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message_id: String,
    /// The conversation this message belongs to.
    #[serde(default, alias = "context_id", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub context_id: String,
    /// The task this message belongs to, if any.
    #[serde(default, alias = "task_id", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub task_id: String,
    /// Who sent it; required.
    #[serde(default, skip_serializing_if = "Role::is_unspecified")]
    pub role: Role,
    /// The content; at least one part.
    #[serde(default, deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<Part>,
    /// Message metadata; extensions keep their data here under their URI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Struct>,
    /// URIs of extensions this message uses.
    #[serde(default, deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub extensions: Vec<String>,
    /// Related tasks.
    #[serde(default, alias = "reference_task_ids", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reference_task_ids: Vec<String>,
}

impl Message {
    /// An agent message with the given parts and a fresh id.
    pub fn agent(parts: Vec<Part>) -> Self {
        Self {
            message_id: uuid::Uuid::new_v4().to_string(),
            role: Role::Agent,
            parts,
            ..Self::default()
        }
    }

    /// A user message with the given parts and a fresh id: what the
    /// gateway sends when it speaks to an agent on its own account.
    pub fn user(parts: Vec<Part>) -> Self {
        Self {
            role: Role::User,
            ..Self::agent(parts)
        }
    }

    /// All text parts joined by newlines.
    pub fn text(&self) -> String {
        self.parts
            .iter()
            .filter_map(Part::as_text)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// `TaskStatus`: a state with an optional message and its time.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskStatus {
    /// The state; required.
    #[serde(default, skip_serializing_if = "TaskState::is_unspecified")]
    pub state: TaskState,
    /// A message that goes with the state (a question, an error, a reason code).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<Message>,
    /// When the state was entered.
    #[serde(default, with = "wire::opt_timestamp")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<DateTime<Utc>>,
}

impl TaskStatus {
    /// A status entered now.
    pub fn now(state: TaskState, message: Option<Message>) -> Self {
        // Millisecond precision, as stored and as the spec prefers.
        let now = Utc::now();
        let millis = DateTime::from_timestamp_millis(now.timestamp_millis()).unwrap_or(now);
        Self {
            state,
            message,
            timestamp: Some(millis),
        }
    }
}

/// `Artifact`: an output of a task.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Artifact {
    /// Unique within the task; required.
    #[serde(default, alias = "artifact_id", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub artifact_id: String,
    /// A human-readable name.
    #[serde(default, deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// A human-readable description.
    #[serde(default, deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// The content; at least one part.
    #[serde(default, deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<Part>,
    /// Artifact metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Struct>,
    /// URIs of extensions used.
    #[serde(default, deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub extensions: Vec<String>,
}

/// `Task`: the unit of work, as stored in the ledger and returned to clients.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Task {
    /// Server-generated id; required.
    #[serde(default, deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// The conversation.
    #[serde(default, alias = "context_id", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub context_id: String,
    /// Current status; required.
    #[serde(default, deserialize_with = "nullable")]
    pub status: TaskStatus,
    /// Outputs.
    #[serde(default, deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<Artifact>,
    /// The messages exchanged, oldest first.
    #[serde(default, deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<Message>,
    /// Task metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Struct>,
}

impl Task {
    /// A copy shaped for a reply: at most `history_length` recent messages
    /// (unset keeps all, 0 keeps none) and artifacts only when asked for.
    pub fn view(&self, history_length: Option<i32>, include_artifacts: bool) -> Task {
        let view = self.borrowed_view(history_length, include_artifacts);
        Task {
            id: self.id.clone(),
            context_id: self.context_id.clone(),
            status: self.status.clone(),
            artifacts: view.artifacts.to_vec(),
            history: view.history.to_vec(),
            metadata: self.metadata.clone(),
        }
    }

    /// Whether [`Task::view`] with these arguments is the whole task.
    pub fn view_is_whole(&self, history_length: Option<i32>, include_artifacts: bool) -> bool {
        kept_history(self.history.len(), history_length) == self.history.len()
            && (include_artifacts || self.artifacts.is_empty())
    }

    /// [`Task::view`] without the copy, for a reply serialized at once.
    pub fn borrowed_view(
        &self,
        history_length: Option<i32>,
        include_artifacts: bool,
    ) -> TaskView<'_> {
        let keep = kept_history(self.history.len(), history_length);
        TaskView {
            id: &self.id,
            context_id: &self.context_id,
            status: &self.status,
            artifacts: if include_artifacts {
                &self.artifacts
            } else {
                &[]
            },
            history: &self.history[self.history.len() - keep..],
            metadata: self.metadata.as_ref(),
        }
    }
}

/// How many of a task's `len` messages a reply keeps: the most recent
/// `history_length` (unset keeps all, 0 and less keep none).
fn kept_history(len: usize, history_length: Option<i32>) -> usize {
    history_length.map_or(len, |n| usize::try_from(n).unwrap_or(0).min(len))
}

/// A task's JSON as Baton wrote it, taken apart into each field's JSON, so
/// that a reply is shaped from the stored bytes without decoding the task.
/// Only for JSON Baton serialized from a [`Task`] (the ledger's records):
/// the fields are copied verbatim, so they must already be exact. Its
/// fields are [`Task`]'s (a test sets every one of them).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskJson<'a> {
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    context_id: Option<&'a RawValue>,
    #[serde(borrow)]
    status: Option<&'a RawValue>,
    #[serde(borrow)]
    artifacts: Option<&'a RawValue>,
    #[serde(borrow, default)]
    history: Vec<&'a RawValue>,
    #[serde(borrow)]
    metadata: Option<&'a RawValue>,
}

impl TaskJson<'_> {
    /// As [`Task::borrowed_view`]; serializes byte for byte as that view.
    pub fn view(&self, history_length: Option<i32>, include_artifacts: bool) -> TaskJsonView<'_> {
        let keep = kept_history(self.history.len(), history_length);
        TaskJsonView {
            id: self.id,
            context_id: self.context_id,
            status: self.status,
            artifacts: self.artifacts.filter(|_| include_artifacts),
            history: &self.history[self.history.len() - keep..],
            metadata: self.metadata,
        }
    }
}

/// A task shaped for a reply, with one field list for both sources: a
/// decoded [`Task`] ([`TaskView`]) and stored JSON ([`TaskJsonView`]).
/// Each field is left out where [`OmitInReply`] says its type is empty,
/// and the fields are in [`Task`]'s order: a reply is either a task's
/// JSON written as it is or one of these views, so both must serialize
/// byte for byte as the [`Task`] that [`Task::view`] returns.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskShape<Id, Status, Artifacts, History, Metadata>
where
    Id: OmitInReply,
    Status: OmitInReply,
    Artifacts: OmitInReply,
    History: OmitInReply,
    Metadata: OmitInReply,
{
    #[serde(skip_serializing_if = "OmitInReply::omit")]
    id: Id,
    #[serde(skip_serializing_if = "OmitInReply::omit")]
    context_id: Id,
    #[serde(skip_serializing_if = "OmitInReply::omit")]
    status: Status,
    #[serde(skip_serializing_if = "OmitInReply::omit")]
    artifacts: Artifacts,
    #[serde(skip_serializing_if = "OmitInReply::omit")]
    history: History,
    #[serde(skip_serializing_if = "OmitInReply::omit")]
    metadata: Metadata,
}

/// A task shaped for a reply, borrowed from a decoded [`Task`].
pub type TaskView<'a> =
    TaskShape<&'a str, &'a TaskStatus, &'a [Artifact], &'a [Message], Option<&'a Struct>>;

/// A [`TaskJson`] shaped for a reply: each field its stored JSON.
pub type TaskJsonView<'a> = TaskShape<
    Option<&'a RawValue>,
    Option<&'a RawValue>,
    Option<&'a RawValue>,
    &'a [&'a RawValue],
    Option<&'a RawValue>,
>;

/// Whether a reply field is left out: ProtoJSON omits empty fields, and a
/// stored task's JSON lacks the fields its encoding omitted. Sealed: it
/// holds only for the field types of [`TaskShape`]'s two views.
pub trait OmitInReply: sealed::Sealed {
    /// The field is not written.
    fn omit(&self) -> bool;
}

mod sealed {
    use super::{RawValue, Struct, TaskStatus};

    pub trait Sealed {}
    impl Sealed for &str {}
    impl<T> Sealed for &[T] {}
    impl Sealed for Option<&RawValue> {}
    impl Sealed for Option<&Struct> {}
    impl Sealed for &TaskStatus {}
}

impl OmitInReply for &str {
    fn omit(&self) -> bool {
        self.is_empty()
    }
}

impl<T> OmitInReply for &[T] {
    fn omit(&self) -> bool {
        self.is_empty()
    }
}

impl OmitInReply for Option<&RawValue> {
    fn omit(&self) -> bool {
        self.is_none()
    }
}

impl OmitInReply for Option<&Struct> {
    fn omit(&self) -> bool {
        self.is_none()
    }
}

impl OmitInReply for &TaskStatus {
    /// A status is always written, as [`Task`] writes it.
    fn omit(&self) -> bool {
        false
    }
}

/// `TaskStatusUpdateEvent`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskStatusUpdateEvent {
    /// The task.
    #[serde(default, alias = "task_id", deserialize_with = "nullable")]
    pub task_id: String,
    /// The task's context.
    #[serde(default, alias = "context_id", deserialize_with = "nullable")]
    pub context_id: String,
    /// The new status.
    #[serde(default, deserialize_with = "nullable")]
    pub status: TaskStatus,
    /// Event metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Struct>,
}

/// `TaskArtifactUpdateEvent`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskArtifactUpdateEvent {
    /// The task.
    #[serde(default, alias = "task_id", deserialize_with = "nullable")]
    pub task_id: String,
    /// The task's context.
    #[serde(default, alias = "context_id", deserialize_with = "nullable")]
    pub context_id: String,
    /// The artifact, or a chunk of it.
    #[serde(default, deserialize_with = "nullable")]
    pub artifact: Artifact,
    /// Append to the earlier artifact with the same id.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "wire::is_false"
    )]
    pub append: bool,
    /// This is the artifact's last chunk.
    #[serde(default, alias = "last_chunk", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "wire::is_false")]
    pub last_chunk: bool,
    /// Event metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Struct>,
}

/// `SendMessageResponse`: a task or a direct message.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum SendMessageResponse {
    /// The task the message created or continued.
    Task(Task),
    /// A direct reply; no task exists.
    Message(Message),
}

/// `StreamResponse`: one event of a stream, a webhook body, or a ledger event.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum StreamResponse {
    /// A task snapshot.
    Task(Task),
    /// A direct message.
    Message(Message),
    /// A status change.
    StatusUpdate(TaskStatusUpdateEvent),
    /// An artifact or artifact chunk.
    ArtifactUpdate(TaskArtifactUpdateEvent),
}

/// Reads the `oneof payload` of the two response wrappers like the other
/// messages: unknown members are ignored, `null` members are unset, and
/// exactly one known member must be set.
fn one_member<T, E: de::Error>(type_name: &str, names: &str, mut members: Vec<T>) -> Result<T, E> {
    if members.len() != 1 {
        return Err(E::custom(format!(
            "a {type_name} must set exactly one of {names} (found {})",
            members.len()
        )));
    }
    Ok(members.remove(0))
}

impl<'de> Deserialize<'de> for SendMessageResponse {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct SendMessageResponseWire {
            #[serde(default)]
            task: Option<Task>,
            #[serde(default)]
            message: Option<Message>,
        }

        let wire = SendMessageResponseWire::deserialize(d)?;
        let members = [wire.task.map(Self::Task), wire.message.map(Self::Message)];
        one_member(
            "SendMessageResponse",
            "task, message",
            members.into_iter().flatten().collect(),
        )
    }
}

impl<'de> Deserialize<'de> for StreamResponse {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct StreamResponseWire {
            #[serde(default)]
            task: Option<Task>,
            #[serde(default)]
            message: Option<Message>,
            #[serde(default, alias = "status_update")]
            status_update: Option<TaskStatusUpdateEvent>,
            #[serde(default, alias = "artifact_update")]
            artifact_update: Option<TaskArtifactUpdateEvent>,
        }

        let wire = StreamResponseWire::deserialize(d)?;
        let members = [
            wire.task.map(Self::Task),
            wire.message.map(Self::Message),
            wire.status_update.map(Self::StatusUpdate),
            wire.artifact_update.map(Self::ArtifactUpdate),
        ];
        one_member(
            "StreamResponse",
            "task, message, statusUpdate, artifactUpdate",
            members.into_iter().flatten().collect(),
        )
    }
}

impl StreamResponse {
    /// The task state this event leaves the task in, if it says.
    pub fn state(&self) -> Option<TaskState> {
        match self {
            Self::Task(task) => Some(task.status.state),
            Self::StatusUpdate(update) => Some(update.status.state),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_data_part_may_hold_null_which_other_contents_treat_as_unset() {
        let part: Part = serde_json::from_value(json!({"data": null})).unwrap();
        assert_eq!(part.content, PartContent::Data(serde_json::Value::Null));
        assert_eq!(serde_json::to_value(&part).unwrap(), json!({"data": null}));
        let part: Part = serde_json::from_value(json!({"text": "a", "url": null})).unwrap();
        assert_eq!(part.as_text(), Some("a"));
        let both = serde_json::from_value::<Part>(json!({"text": "a", "data": null}));
        assert!(both.unwrap_err().to_string().contains("found 2"));
        assert!(serde_json::from_value::<Part>(json!({})).is_err());
    }

    #[test]
    fn a_turn_settles_in_a_terminal_or_an_interrupted_state_only() {
        let settled: Vec<TaskState> = TaskState::VALUES
            .iter()
            .map(|(state, _, _)| *state)
            .filter(|state| state.is_settled())
            .collect();
        assert_eq!(
            settled,
            [
                TaskState::Completed,
                TaskState::Failed,
                TaskState::Canceled,
                TaskState::InputRequired,
                TaskState::Rejected,
                TaskState::AuthRequired,
            ]
        );
    }

    #[test]
    fn a_view_of_a_tasks_json_is_byte_for_byte_the_view_of_the_task() {
        let full: Task = serde_json::from_value(json!({
            "id": "t1",
            "contextId": "c1",
            "status": {
                "state": "TASK_STATE_INPUT_REQUIRED",
                "message": {"messageId": "q", "role": "ROLE_AGENT", "parts": [{"text": "which \"one\"?\n"}]},
                "timestamp": "2026-12-02T03:04:05.678Z"
            },
            "artifacts": [
                {"artifactId": "a1", "parts": [{"data": {"n": 1.5, "z": [null, true]}, "mediaType": "application/json"}]},
                {"artifactId": "a2", "name": "\u{e9}t\u{e9} \u{1f600}", "parts": [{"url": "https://x/y", "filename": "y"}]}
            ],
            "history": [
                {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "one"}], "metadata": {"b": 2, "a": "1"}},
                {"messageId": "m2", "role": "ROLE_AGENT", "parts": [{"raw": "AAEC"}], "taskId": "t1"},
                {"messageId": "m3", "role": "ROLE_USER", "parts": [{"text": "three"}], "referenceTaskIds": ["t0"]}
            ],
            "metadata": {"k": {"nested": ["v", 2]}}
        }))
        .unwrap();
        // Every field set; destructured whole, so a field added to Task
        // stops this test from compiling until it is set here too.
        let Task {
            id,
            context_id,
            status,
            artifacts,
            history,
            metadata,
        } = &full;
        assert!(!id.is_empty() && !context_id.is_empty() && status.message.is_some());
        assert!(!artifacts.is_empty() && !history.is_empty() && metadata.is_some());
        let bare = Task {
            id: "t2".into(),
            ..Task::default()
        };
        let no_artifacts = Task {
            artifacts: Vec::new(),
            metadata: None,
            ..full.clone()
        };
        for task in [full, bare, no_artifacts, Task::default()] {
            let json = serde_json::to_string(&task).unwrap();
            let parts: TaskJson = serde_json::from_str(&json).unwrap();
            for history_length in [None, Some(0), Some(1), Some(2), Some(3), Some(9), Some(-1)] {
                for include_artifacts in [true, false] {
                    assert_eq!(
                        serde_json::to_string(&parts.view(history_length, include_artifacts))
                            .unwrap(),
                        // `Task::view` serializes through `Task`, not the
                        // shape both views share.
                        serde_json::to_string(&task.view(history_length, include_artifacts))
                            .unwrap(),
                        "{json} {history_length:?} {include_artifacts}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_borrowed_view_serializes_as_the_copied_view() {
        let message = |id: &str| Message {
            message_id: id.into(),
            role: Role::User,
            parts: vec![Part::text("hi")],
            ..Message::default()
        };
        let task: Task = serde_json::from_value(json!({
            "id": "t1",
            "contextId": "c1",
            "status": {"state": "TASK_STATE_COMPLETED"},
            "artifacts": [{"artifactId": "a1", "parts": [{"text": "ok"}]}],
            "metadata": {"k": "v"}
        }))
        .unwrap();
        let task = Task {
            history: vec![message("m1"), message("m2"), message("m3")],
            ..task
        };
        for history_length in [None, Some(0), Some(2), Some(9), Some(-1)] {
            for include_artifacts in [true, false] {
                // Compared as text: field order is part of the bytes.
                assert_eq!(
                    serde_json::to_string(&task.borrowed_view(history_length, include_artifacts))
                        .unwrap(),
                    serde_json::to_string(&task.view(history_length, include_artifacts)).unwrap(),
                    "{history_length:?} {include_artifacts}"
                );
            }
        }
        let kept = |history_length| {
            let view = task.borrowed_view(history_length, true);
            view.history
                .iter()
                .map(|m| m.message_id.as_str())
                .collect::<Vec<_>>()
        };
        assert_eq!(kept(Some(2)), ["m2", "m3"]);
        assert_eq!(kept(None), ["m1", "m2", "m3"]);
        assert!(kept(Some(0)).is_empty() && kept(Some(-1)).is_empty());
        let empty = Task::default();
        assert_eq!(
            serde_json::to_value(empty.borrowed_view(None, true)).unwrap(),
            serde_json::to_value(&empty).unwrap()
        );
    }
}
