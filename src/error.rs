//! `GatewayError` and its one mapping onto JSON-RPC errors.
//!
//! Error policy: every failure a caller can see is a variant here, and
//! [`GatewayError::to_rpc_error`] is the only place that turns one into a
//! `{code, message, data}` object. A2A errors (-32001…-32009) always carry a
//! `google.rpc.ErrorInfo` entry; invalid params carry `google.rpc.BadRequest`
//! field violations. Conversion has no side effects: logging happens where the
//! error is handled, not here.

use crate::handoff::reasons;
use serde::Serialize;
use serde_json::{Value, json};

/// The error-detail domain of A2A errors.
pub const A2A_DOMAIN: &str = "a2a-protocol.org";

/// One invalid field, as in `google.rpc.BadRequest.FieldViolation`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FieldViolation {
    /// Path of the field, e.g. `message.parts[0]`.
    pub field: String,
    /// What is wrong with it.
    pub description: String,
}

impl FieldViolation {
    /// A violation of `field`.
    pub fn new(field: impl Into<String>, description: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            description: description.into(),
        }
    }
}

/// Everything that can go wrong while serving a request.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// -32700: the body is not JSON.
    #[error("invalid JSON payload: {0}")]
    Parse(String),
    /// -32600: JSON, but not a valid JSON-RPC request.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// -32601.
    #[error("method not found: {0}")]
    MethodNotFound(String),
    /// -32602, with the failing fields.
    #[error("invalid params: {message}")]
    InvalidParams {
        /// A summary.
        message: String,
        /// Each failing field.
        violations: Vec<FieldViolation>,
    },
    /// -32603.
    #[error("internal error: {0}")]
    Internal(String),
    /// -32001.
    #[error("task not found: {0}")]
    TaskNotFound(String),
    /// -32001 too: a push config the task does not have.
    #[error("push config {config_id} of task {task_id} not found")]
    PushConfigNotFound {
        /// The task.
        task_id: String,
        /// The config asked for.
        config_id: String,
    },
    /// -32002.
    #[error("task {task_id} cannot be canceled in state {state}")]
    TaskNotCancelable {
        /// The task.
        task_id: String,
        /// Its state: terminal, or one its agent refused to cancel in.
        state: String,
    },
    /// -32003.
    #[error("push notifications are not supported")]
    PushNotificationNotSupported,
    /// -32004.
    #[error("unsupported operation: {0}")]
    UnsupportedOperation(String),
    /// -32005.
    #[error("content type not supported: {0}")]
    ContentTypeNotSupported(String),
    /// -32006.
    #[error("invalid agent response: {detail}")]
    InvalidAgentResponse {
        /// What was wrong with the answer.
        detail: String,
        /// The agent's id, once known ([`GatewayError::about_agent`]).
        agent: Option<String>,
    },
    /// -32007.
    #[error("the extended agent card is not configured")]
    ExtendedAgentCardNotConfigured,
    /// -32008.
    #[error("extension {0} is required but was not activated")]
    ExtensionSupportRequired(String),
    /// -32009. `stated` is false when the request named no version, which
    /// the spec reads as 0.3 (§3.6.2).
    #[error("{}", version_not_supported(.version, *.stated))]
    VersionNotSupported {
        /// The version the request is read as.
        version: String,
        /// Whether the request named it (header or query parameter).
        stated: bool,
    },
    /// HTTP 401: no valid API key (a -32600 body with reason UNAUTHENTICATED).
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// -32603: the agent behind the gateway could not be reached.
    #[error("agent unreachable: {detail}")]
    UpstreamUnreachable {
        /// What failed.
        detail: String,
        /// The agent's id, once known ([`GatewayError::about_agent`]).
        agent: Option<String>,
    },
    /// -32603: the agent behind the gateway did not answer in time.
    #[error("agent timed out: {detail}")]
    UpstreamTimeout {
        /// What failed.
        detail: String,
        /// The agent's id, once known ([`GatewayError::about_agent`]).
        agent: Option<String>,
    },
    /// -32603: the ledger cannot make writes durable: no send starts, and
    /// a read that would wait for a write fails.
    #[error("{0}")]
    LedgerUnavailable(String),
    /// -32603: Baton is stopping, and ends a stream whose task goes on: the
    /// last event of a stream cut short, so that no client takes the close
    /// for the task's end.
    #[error("Baton is stopping; task {task_id} goes on: resubscribe with SubscribeToTask")]
    Stopping {
        /// The task the stream was about.
        task_id: String,
    },
    /// An agent's own JSON-RPC error, passed on unchanged.
    #[error("{message}")]
    Upstream {
        /// The agent's code.
        code: i64,
        /// The agent's message.
        message: String,
        /// The agent's data.
        data: Option<Value>,
    },
}

/// The ErrorInfo domain of Baton's own reasons (upstream faults).
pub const BATON_DOMAIN: &str = "baton.gateway";

/// An agent's fault as the caller's error. It knows no agent id: where the
/// agent is known, add it with [`GatewayError::about_agent`].
impl From<crate::agents::AgentError> for GatewayError {
    fn from(err: crate::agents::AgentError) -> Self {
        use crate::agents::AgentError as A;
        match err {
            A::InvalidInput(detail) => Self::invalid_field("message", detail),
            A::Failed(detail) => Self::Internal(detail),
            A::Unreachable(detail) => Self::UpstreamUnreachable {
                detail,
                agent: None,
            },
            A::Timeout(detail) => Self::UpstreamTimeout {
                detail,
                agent: None,
            },
            A::NotJson(detail) => Self::invalid_agent_response(format!("not JSON: {detail}")),
            A::InvalidResponse(detail) => Self::invalid_agent_response(detail),
            // Codes about the envelope Baton sent the agent, not about the
            // caller's request: the agent did not answer as an A2A server.
            // So is -32009: the version refused is the 1.0 Baton sends.
            A::Refused {
                code: code @ (-32700 | -32600 | -32601 | -32009),
                message,
                ..
            } => Self::invalid_agent_response(format!(
                "the agent answered JSON-RPC error {code} ({message}) to a well-formed A2A call"
            )),
            A::Refused {
                code,
                message,
                data,
            } => Self::Upstream {
                code,
                message,
                // A2A error details are typed objects (`@type`); others are dropped.
                data: data.filter(is_error_details),
            },
        }
    }
}

/// Whether `data` is A2A error details: an array of objects naming their `@type`.
fn is_error_details(data: &serde_json::Value) -> bool {
    data.as_array().is_some_and(|details| {
        details.iter().all(|detail| {
            detail
                .get("@type")
                .is_some_and(serde_json::Value::is_string)
        })
    })
}

impl GatewayError {
    /// -32602 for one field.
    pub fn invalid_field(field: impl Into<String>, description: impl Into<String>) -> Self {
        let violation = FieldViolation::new(field, description);
        Self::InvalidParams {
            message: format!("{}: {}", violation.field, violation.description),
            violations: vec![violation],
        }
    }

    /// -32602 for several fields at once.
    pub fn invalid_fields(violations: Vec<FieldViolation>) -> Self {
        let message = violations
            .iter()
            .map(|v| format!("{}: {}", v.field, v.description))
            .collect::<Vec<_>>()
            .join("; ");
        Self::InvalidParams {
            message,
            violations,
        }
    }

    /// -32006 for an agent's answer, its agent not named yet.
    pub fn invalid_agent_response(detail: impl Into<String>) -> Self {
        Self::InvalidAgentResponse {
            detail: detail.into(),
            agent: None,
        }
    }

    /// The error with the id of the agent it is about, where it names one
    /// (an upstream that failed, did not answer, or answered amiss).
    #[must_use]
    pub fn about_agent(mut self, agent_id: &str) -> Self {
        if let Self::UpstreamUnreachable { agent, .. }
        | Self::UpstreamTimeout { agent, .. }
        | Self::InvalidAgentResponse { agent, .. } = &mut self
        {
            *agent = Some(agent_id.to_string());
        }
        self
    }

    /// The JSON-RPC error code.
    pub fn code(&self) -> i64 {
        match self {
            Self::Parse(_) => -32700,
            Self::InvalidRequest(_) | Self::Unauthenticated(_) => -32600,
            Self::MethodNotFound(_) => -32601,
            Self::InvalidParams { .. } => -32602,
            Self::Internal(_)
            | Self::UpstreamUnreachable { .. }
            | Self::UpstreamTimeout { .. }
            | Self::LedgerUnavailable(_)
            | Self::Stopping { .. } => -32603,
            Self::TaskNotFound(_) | Self::PushConfigNotFound { .. } => -32001,
            Self::TaskNotCancelable { .. } => -32002,
            Self::PushNotificationNotSupported => -32003,
            Self::UnsupportedOperation(_) => -32004,
            Self::ContentTypeNotSupported(_) => -32005,
            Self::InvalidAgentResponse { .. } => -32006,
            Self::ExtendedAgentCardNotConfigured => -32007,
            Self::ExtensionSupportRequired(_) => -32008,
            Self::VersionNotSupported { .. } => -32009,
            Self::Upstream { code, .. } => *code,
        }
    }

    /// The `ErrorInfo.reason` of A2A errors (UPPER_SNAKE_CASE, no `Error` suffix).
    pub fn reason(&self) -> Option<&'static str> {
        Some(match self {
            Self::TaskNotFound(_) | Self::PushConfigNotFound { .. } => "TASK_NOT_FOUND",
            Self::TaskNotCancelable { .. } => "TASK_NOT_CANCELABLE",
            Self::PushNotificationNotSupported => "PUSH_NOTIFICATION_NOT_SUPPORTED",
            Self::UnsupportedOperation(_) => "UNSUPPORTED_OPERATION",
            Self::ContentTypeNotSupported(_) => "CONTENT_TYPE_NOT_SUPPORTED",
            Self::InvalidAgentResponse { .. } => reasons::INVALID_AGENT_RESPONSE,
            Self::ExtendedAgentCardNotConfigured => "EXTENDED_AGENT_CARD_NOT_CONFIGURED",
            Self::ExtensionSupportRequired(_) => "EXTENSION_SUPPORT_REQUIRED",
            Self::VersionNotSupported { .. } => "VERSION_NOT_SUPPORTED",
            _ => return None,
        })
    }

    /// Whether the same request may succeed if tried again.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Internal(_)
                | Self::InvalidAgentResponse { .. }
                | Self::UpstreamUnreachable { .. }
                | Self::UpstreamTimeout { .. }
                | Self::LedgerUnavailable(_)
                | Self::Stopping { .. }
        )
    }

    /// `ErrorInfo.metadata`: the identifiers the error is about.
    fn info_metadata(&self) -> Value {
        match self {
            Self::TaskNotFound(task_id) | Self::Stopping { task_id } => {
                json!({ "taskId": task_id })
            }
            Self::PushConfigNotFound { task_id, config_id } => {
                json!({ "taskId": task_id, "configId": config_id })
            }
            Self::TaskNotCancelable { task_id, state } => {
                json!({ "taskId": task_id, "state": state })
            }
            Self::VersionNotSupported { version, .. } => {
                json!({ "requestedVersion": version, "supportedVersions": "1.0" })
            }
            Self::ExtensionSupportRequired(uri) => json!({ "extension": uri }),
            Self::UpstreamUnreachable {
                agent: Some(agent), ..
            }
            | Self::UpstreamTimeout {
                agent: Some(agent), ..
            }
            | Self::InvalidAgentResponse {
                agent: Some(agent), ..
            } => json!({ "agentId": agent }),
            _ => json!({}),
        }
    }

    /// The JSON-RPC `error` object.
    pub fn to_rpc_error(&self) -> Value {
        let message = self.to_string();
        let baton_reason = match self {
            Self::UpstreamUnreachable { .. } => Some(reasons::UPSTREAM_UNREACHABLE),
            Self::UpstreamTimeout { .. } => Some(reasons::UPSTREAM_TIMEOUT),
            Self::LedgerUnavailable(_) => Some("LEDGER_UNAVAILABLE"),
            Self::Stopping { .. } => Some("GATEWAY_STOPPING"),
            Self::Unauthenticated(_) => Some("UNAUTHENTICATED"),
            _ => None,
        };
        if let Some(reason) = baton_reason {
            return json!({
                "code": self.code(),
                "message": message,
                "data": [{
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": reason,
                    "domain": BATON_DOMAIN,
                    "metadata": self.info_metadata(),
                }],
            });
        }
        if let Self::Upstream {
            code,
            message,
            data,
        } = self
        {
            let mut error = json!({ "code": code, "message": message });
            if let Some(data) = data {
                error["data"] = data.clone();
            }
            return error;
        }
        if let Some(reason) = self.reason() {
            return json!({
                "code": self.code(),
                "message": message,
                "data": [{
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": reason,
                    "domain": A2A_DOMAIN,
                    "metadata": self.info_metadata(),
                }],
            });
        }
        match self {
            Self::InvalidParams { violations, .. } if !violations.is_empty() => json!({
                "code": self.code(),
                "message": message,
                "data": [{
                    "@type": "type.googleapis.com/google.rpc.BadRequest",
                    "fieldViolations": violations,
                }],
            }),
            _ => json!({ "code": self.code(), "message": message }),
        }
    }
}

/// The message of [`GatewayError::VersionNotSupported`].
fn version_not_supported(version: &str, stated: bool) -> String {
    if stated {
        format!("A2A version {version:?} is not supported; this server speaks 1.0")
    } else {
        format!(
            "the request names no A2A version (an A2A-Version header or query parameter), \
             so it is read as {version}, which this server does not speak; send A2A-Version: 1.0"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a2a_errors_carry_error_info() {
        let error = GatewayError::TaskNotFound("t1".into()).to_rpc_error();
        assert_eq!(error["code"], -32001);
        assert_eq!(error["data"][0]["reason"], "TASK_NOT_FOUND");
        assert_eq!(error["data"][0]["domain"], A2A_DOMAIN);
        assert_eq!(error["data"][0]["metadata"]["taskId"], "t1");
    }

    #[test]
    fn an_upstream_fault_names_its_agent_once_known() {
        let unreachable = GatewayError::UpstreamUnreachable {
            detail: "refused".into(),
            agent: None,
        };
        assert_eq!(unreachable.to_rpc_error()["data"][0]["metadata"], json!({}));
        let named = unreachable.about_agent("billing").to_rpc_error();
        assert_eq!(named["data"][0]["metadata"], json!({"agentId": "billing"}));
        assert_eq!(named["data"][0]["reason"], "UPSTREAM_UNREACHABLE");
        // Errors about no agent are left as they are.
        let not_found = GatewayError::TaskNotFound("t".into()).about_agent("billing");
        assert_eq!(
            not_found.to_rpc_error()["data"][0]["metadata"],
            json!({"taskId": "t"})
        );
    }

    #[test]
    fn invalid_params_carry_field_violations() {
        let error =
            GatewayError::invalid_field("message.parts", "must not be empty").to_rpc_error();
        assert_eq!(error["code"], -32602);
        let violation = &error["data"][0]["fieldViolations"][0];
        assert_eq!(violation["field"], "message.parts");
    }

    #[test]
    fn an_agents_refusal_is_passed_on_only_as_an_a2a_error() {
        use crate::agents::AgentError;
        let refused = |code, data| {
            GatewayError::from(AgentError::Refused {
                code,
                message: "from the agent".into(),
                data,
            })
            .to_rpc_error()
        };
        // About the envelope (or version) Baton sent, so the agent's fault,
        // not the caller's.
        for code in [-32700, -32600, -32601, -32009] {
            let error = refused(code, None);
            assert_eq!(error["code"], -32006, "{code}: {error}");
            assert_eq!(error["data"][0]["reason"], "INVALID_AGENT_RESPONSE");
        }
        let details = serde_json::json!([{"@type": "type.googleapis.com/google.rpc.ErrorInfo"}]);
        let error = refused(-32001, Some(details.clone()));
        assert_eq!(error["code"], -32001);
        assert_eq!(error["data"], details);
        let error = refused(-32602, Some(serde_json::json!({"hint": "not an array"})));
        assert_eq!(error["code"], -32602);
        assert!(
            error.get("data").is_none(),
            "untyped details are dropped: {error}"
        );
    }
}
