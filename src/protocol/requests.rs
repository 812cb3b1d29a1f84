//! Request and response objects of the eleven A2A 1.0 methods (`a2a.proto`).

use super::types::{Message, Task, TaskState};
use super::wire::{self, Struct, is_false, nullable};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// `SendMessageConfiguration`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendMessageConfiguration {
    /// Media types the client accepts in the reply.
    #[serde(
        default,
        alias = "accepted_output_modes",
        deserialize_with = "nullable"
    )]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub accepted_output_modes: Vec<String>,
    /// A push config registered together with the new task.
    #[serde(default, alias = "task_push_notification_config")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task_push_notification_config: Option<TaskPushNotificationConfig>,
    /// How many recent messages to return.
    #[serde(default, alias = "history_length", with = "wire::opt_int32")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub history_length: Option<i32>,
    /// Return at once instead of waiting for a terminal or interrupted state.
    #[serde(default, alias = "return_immediately", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "is_false")]
    pub return_immediately: bool,
}

/// `SendMessageRequest`, for SendMessage and SendStreamingMessage.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendMessageRequest {
    /// Tenant (at Baton: an agent id).
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub tenant: String,
    /// The message; required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<Message>,
    /// Delivery options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub configuration: Option<SendMessageConfiguration>,
    /// Request metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Struct>,
}

/// `GetTaskRequest`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GetTaskRequest {
    /// Tenant.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub tenant: String,
    /// The task id; required.
    #[serde(default, deserialize_with = "nullable")]
    pub id: String,
    /// How many recent messages to return.
    #[serde(default, alias = "history_length", with = "wire::opt_int32")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub history_length: Option<i32>,
}

/// `ListTasksRequest`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListTasksRequest {
    /// Tenant.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub tenant: String,
    /// Only tasks of this context.
    #[serde(default, alias = "context_id", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub context_id: String,
    /// Only tasks in this state.
    #[serde(default, skip_serializing_if = "TaskState::is_unspecified")]
    pub status: TaskState,
    /// Page size, 1 to 100 (default 50).
    #[serde(default, alias = "page_size", with = "wire::opt_int32")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page_size: Option<i32>,
    /// Cursor from a previous page.
    #[serde(default, alias = "page_token", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub page_token: String,
    /// How many recent messages per task.
    #[serde(default, alias = "history_length", with = "wire::opt_int32")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub history_length: Option<i32>,
    /// Only tasks whose status changed at or after this time.
    #[serde(
        default,
        alias = "status_timestamp_after",
        with = "wire::opt_timestamp"
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status_timestamp_after: Option<DateTime<Utc>>,
    /// Include artifacts.
    #[serde(
        default,
        alias = "include_artifacts",
        skip_serializing_if = "Option::is_none"
    )]
    pub include_artifacts: Option<bool>,
}

/// `ListTasksResponse`: every field is always present. `T` is how a task
/// is held: decoded, or as the gateway's reply shaped from stored JSON.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListTasksResponse<T = Task> {
    /// The page.
    #[serde(default, deserialize_with = "nullable")]
    #[serde(bound(deserialize = "T: Deserialize<'de>"))]
    pub tasks: Vec<T>,
    /// Cursor of the next page; empty on the last page.
    #[serde(default, alias = "next_page_token", deserialize_with = "nullable")]
    pub next_page_token: String,
    /// The page size used.
    #[serde(default, alias = "page_size", deserialize_with = "wire::int32")]
    pub page_size: i32,
    /// How many tasks match in all.
    #[serde(default, alias = "total_size", deserialize_with = "wire::int32")]
    pub total_size: i32,
}

/// `CancelTaskRequest`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CancelTaskRequest {
    /// Tenant.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub tenant: String,
    /// The task id; required.
    #[serde(default, deserialize_with = "nullable")]
    pub id: String,
    /// Request metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Struct>,
}

/// `SubscribeToTaskRequest`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SubscribeToTaskRequest {
    /// Tenant.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub tenant: String,
    /// The task id; required.
    #[serde(default, deserialize_with = "nullable")]
    pub id: String,
}

/// `AuthenticationInfo`: credentials the server sends to a webhook.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthenticationInfo {
    /// IANA HTTP scheme, e.g. `Bearer`; required.
    #[serde(default, deserialize_with = "nullable")]
    pub scheme: String,
    /// The credentials.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub credentials: String,
}

/// `TaskPushNotificationConfig`: a webhook for one task.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskPushNotificationConfig {
    /// Tenant.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub tenant: String,
    /// Config id, unique within the task.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub id: String,
    /// The task.
    #[serde(default, alias = "task_id", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub task_id: String,
    /// The webhook URL; required.
    #[serde(default, deserialize_with = "nullable")]
    pub url: String,
    /// Sent back in the notification token header.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub token: String,
    /// Credentials for the `Authorization` header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authentication: Option<AuthenticationInfo>,
}

/// `GetTaskPushNotificationConfigRequest` and `DeleteTaskPushNotificationConfigRequest`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskPushNotificationConfigRef {
    /// Tenant.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub tenant: String,
    /// The task; required.
    #[serde(default, alias = "task_id", deserialize_with = "nullable")]
    pub task_id: String,
    /// The config id; required.
    #[serde(default, deserialize_with = "nullable")]
    pub id: String,
}

/// `ListTaskPushNotificationConfigsRequest`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListTaskPushNotificationConfigsRequest {
    /// Tenant.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub tenant: String,
    /// The task; required.
    #[serde(default, alias = "task_id", deserialize_with = "nullable")]
    pub task_id: String,
    /// Page size (0: the server's default).
    #[serde(default, alias = "page_size", deserialize_with = "wire::int32")]
    #[serde(skip_serializing_if = "wire::is_zero")]
    pub page_size: i32,
    /// Cursor from a previous page.
    #[serde(default, alias = "page_token", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub page_token: String,
}

/// `ListTaskPushNotificationConfigsResponse`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListTaskPushNotificationConfigsResponse {
    /// The page.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub configs: Vec<TaskPushNotificationConfig>,
    /// Cursor of the next page; omitted on the last page.
    #[serde(default, alias = "next_page_token", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub next_page_token: String,
}

/// `GetExtendedAgentCardRequest`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GetExtendedAgentCardRequest {
    /// Tenant.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub tenant: String,
}
