//! The registry's record of an agent, as stored in the ledger and returned by
//! the registry methods (DESIGN.md §4).

use crate::protocol::AgentCard;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// Health of an agent, from the periodic card re-fetch.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Health {
    /// `unknown` until checked, then `healthy` or `unhealthy`.
    pub status: HealthStatus,
    /// When it was last checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checked: Option<DateTime<Utc>>,
    /// Round trip of the last check, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    /// Why the last check failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Health {
    /// A check at `at` that found the agent up, answering in `latency`.
    pub fn healthy(at: DateTime<Utc>, latency: std::time::Duration) -> Self {
        Self {
            status: HealthStatus::Healthy,
            last_checked: Some(at),
            latency_ms: Some(latency.as_millis().try_into().unwrap_or(u64::MAX)),
            error: None,
        }
    }
}

/// Health states.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthStatus {
    /// Not checked yet.
    #[default]
    Unknown,
    /// The last check succeeded.
    Healthy,
    /// The last check failed.
    Unhealthy,
}

impl AgentRecord {
    /// The limits and checks the gateway applies to the agent.
    pub fn policy(&self) -> crate::registry::directory::AgentPolicy {
        use std::time::Duration;
        crate::registry::directory::AgentPolicy {
            task_timeout: self.task_timeout_ms.map(Duration::from_millis),
            max_hops: self.max_hops,
            ack_timeout: self.ack_timeout_ms.map(Duration::from_millis),
            allow_from: self.allow_from.clone(),
            skill_output_schemas: self.skill_output_schemas.clone().map(std::sync::Arc::new),
        }
    }
}

/// An agent as the registry knows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentRecord {
    /// The agent id: path segment and tenant.
    pub id: String,
    /// The agency that registered it.
    pub owner: String,
    /// The card as registered.
    pub card: AgentCard,
    /// The card as Baton publishes it.
    pub published_card: AgentCard,
    /// ETag of the published card.
    pub etag: String,
    /// First registration.
    pub registered_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// Last health check.
    #[serde(default)]
    pub health: Health,
    /// Where the card was fetched from, when registered by URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub card_url: Option<String>,
    /// JSON Schemas of skill outputs, by skill id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skill_output_schemas: Option<serde_json::Map<String, serde_json::Value>>,
    /// The agent's task timeout, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_timeout_ms: Option<u64>,
    /// The agent's hop limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_hops: Option<u32>,
    /// How long the agent may take to acknowledge, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack_timeout_ms: Option<u64>,
    /// The agents allowed to hand off to it (absent: every agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_from: Option<Vec<String>>,
    /// Served in-process by Baton rather than over the network.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub builtin: bool,
}
