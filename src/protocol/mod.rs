//! The A2A 1.0 wire protocol: ProtoJSON types, method names and error codes.
//!
//! Types are hand-written serde structs rather than generated ones; the README's
//! design notes say why.

pub mod card;
pub mod requests;
pub mod types;
pub mod wire;

pub use card::*;
pub use requests::*;
pub use types::*;
pub use wire::ProtoEnum;

/// JSON-RPC method names of A2A 1.0, verbatim from the spec.
pub mod methods {
    /// SendMessage.
    pub const SEND_MESSAGE: &str = "SendMessage";
    /// SendStreamingMessage.
    pub const SEND_STREAMING_MESSAGE: &str = "SendStreamingMessage";
    /// GetTask.
    pub const GET_TASK: &str = "GetTask";
    /// ListTasks.
    pub const LIST_TASKS: &str = "ListTasks";
    /// CancelTask.
    pub const CANCEL_TASK: &str = "CancelTask";
    /// SubscribeToTask.
    pub const SUBSCRIBE_TO_TASK: &str = "SubscribeToTask";
    /// CreateTaskPushNotificationConfig.
    pub const CREATE_PUSH_CONFIG: &str = "CreateTaskPushNotificationConfig";
    /// GetTaskPushNotificationConfig.
    pub const GET_PUSH_CONFIG: &str = "GetTaskPushNotificationConfig";
    /// ListTaskPushNotificationConfigs.
    pub const LIST_PUSH_CONFIGS: &str = "ListTaskPushNotificationConfigs";
    /// DeleteTaskPushNotificationConfig.
    pub const DELETE_PUSH_CONFIG: &str = "DeleteTaskPushNotificationConfig";
    /// GetExtendedAgentCard.
    pub const GET_EXTENDED_AGENT_CARD: &str = "GetExtendedAgentCard";
    /// Every method, in the spec's order.
    pub const ALL: [&str; 11] = [
        SEND_MESSAGE,
        SEND_STREAMING_MESSAGE,
        GET_TASK,
        LIST_TASKS,
        CANCEL_TASK,
        SUBSCRIBE_TO_TASK,
        CREATE_PUSH_CONFIG,
        GET_PUSH_CONFIG,
        LIST_PUSH_CONFIGS,
        DELETE_PUSH_CONFIG,
        GET_EXTENDED_AGENT_CARD,
    ];
    /// The four push-notification-config methods.
    pub const PUSH_CONFIG_METHODS: [&str; 4] = [
        CREATE_PUSH_CONFIG,
        GET_PUSH_CONFIG,
        LIST_PUSH_CONFIGS,
        DELETE_PUSH_CONFIG,
    ];
}

/// The protocol version Baton speaks.
pub const PROTOCOL_VERSION: &str = "1.0";

/// The handoff extension's URI (DESIGN.md §3).
pub const HANDOFF_EXTENSION: &str = "urn:baton:handoff:v1";
