//! The handoff graph below one gateway task, as a tree (`GET
//! /tasks/{taskId}/trace`, `baton trace`): each task with its agent, state,
//! hops and reason code, and the tasks handed off from it.
//!
//! Only the root is checked against the caller: the tasks below it belong to
//! its graph, whoever created them, as for the cascading cancel. The walk is
//! bounded ([`MAX_TRACE_DEPTH`], [`MAX_TRACE_NODES`]); a cut tree says so.

use super::{CallContext, Gateway};
use crate::error::GatewayError;
use crate::handoff::control::Control;
use crate::handoff::reasons::STATUS_MEDIA_TYPE;
use crate::protocol::{PartContent, Task, TaskState};
use crate::store::{HopRecord, TaskRecord};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::Arc;

/// Deepest level of children a trace follows (the root is level 0).
pub const MAX_TRACE_DEPTH: usize = 32;

/// Most tasks one trace holds.
pub const MAX_TRACE_NODES: usize = 1000;

/// One task of a trace, with the tasks handed off from it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TraceNode {
    /// The gateway task id.
    pub task_id: String,
    /// Its context id.
    pub context_id: String,
    /// The trace id of its control metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// Its current state.
    pub state: TaskState,
    /// The agent currently responsible.
    pub agent: String,
    /// When the gateway created it, in microseconds as the ledger keeps it
    /// (a record still in memory has nanoseconds).
    #[serde(with = "crate::protocol::wire::record_timestamp")]
    pub created_at: DateTime<Utc>,
    /// When it entered its current state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<DateTime<Utc>>,
    /// The task it was handed off from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_task_id: Option<String>,
    /// Every agent's turn holding it, in order.
    #[serde(default)]
    pub hops: Vec<HopRecord>,
    /// The reason code of its current status (DESIGN.md §3.4), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The tasks handed off from it, oldest first.
    #[serde(default)]
    pub children: Vec<TraceNode>,
}

/// A trace: the root task's tree, and whether a bound cut it short.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TraceReport {
    /// The task asked for, with everything below it.
    #[serde(flatten)]
    pub root: TraceNode,
    /// Some tasks were left out: deeper than [`MAX_TRACE_DEPTH`], or beyond
    /// [`MAX_TRACE_NODES`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// The state of one walk: what was visited and whether anything was cut.
#[derive(Default)]
struct Walk {
    seen: HashSet<String>,
    truncated: bool,
}

impl Gateway {
    /// The handoff tree below `task_id`, which must be the caller's task.
    pub fn trace(&self, ctx: &CallContext, task_id: &str) -> Result<TraceReport, GatewayError> {
        let root = self.owned_task(ctx, task_id)?;
        let mut walk = Walk::default();
        walk.seen.insert(root.task.id.clone());
        let root = self.trace_node(Arc::unwrap_or_clone(root), 0, &mut walk)?;
        Ok(TraceReport {
            root,
            truncated: walk.truncated,
        })
    }

    fn trace_node(
        &self,
        record: TaskRecord,
        depth: usize,
        walk: &mut Walk,
    ) -> Result<TraceNode, GatewayError> {
        let child_ids = self.ledger.children(&record.task.id)?;
        let mut node = node_of(record);
        if depth >= MAX_TRACE_DEPTH {
            walk.truncated |= !child_ids.is_empty();
            return Ok(node);
        }
        let mut children = Vec::with_capacity(child_ids.len());
        for child_id in child_ids {
            if walk.seen.len() >= MAX_TRACE_NODES {
                walk.truncated = true;
                break;
            }
            // A graph written by this gateway has no cycles; a damaged one must not loop.
            if !walk.seen.insert(child_id.clone()) {
                continue;
            }
            if let Some(child) = self.ledger.get(&child_id)? {
                children.push(child);
            }
        }
        // Keys order children by id; creation time is what a reader expects.
        children.sort_by(|a, b| (a.created_at, &a.task.id).cmp(&(b.created_at, &b.task.id)));
        for child in children {
            node.children.push(self.trace_node(child, depth + 1, walk)?);
        }
        Ok(node)
    }
}

/// A task's own part of the trace, without children.
fn node_of(record: TaskRecord) -> TraceNode {
    let task = &record.task;
    TraceNode {
        task_id: task.id.clone(),
        context_id: task.context_id.clone(),
        trace_id: Control::read_from(task.metadata.as_ref())
            .map(|control| control.trace_id)
            .filter(|id| !id.is_empty()),
        state: task.status.state,
        agent: record.agent.clone(),
        created_at: record.created_at,
        updated_at: task.status.timestamp,
        parent_task_id: record.parent_task_id.clone(),
        reason: status_reason(task),
        // A delivery (or an answer) kept for a restart is the task's
        // content, not its path.
        hops: record
            .hops
            .into_iter()
            .map(|hop| HopRecord {
                undelivered: None,
                escalation_answers: Vec::new(),
                ..hop
            })
            .collect(),
        children: Vec::new(),
    }
}

/// The reason code in the status message's status part, if any.
fn status_reason(task: &Task) -> Option<String> {
    let message = task.status.message.as_ref()?;
    message
        .parts
        .iter()
        .filter(|part| part.media_type == STATUS_MEDIA_TYPE)
        .find_map(|part| match &part.content {
            PartContent::Data(data) => data.get("reason")?.as_str().map(str::to_string),
            _ => None,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::reasons::{self, status_part};
    use crate::protocol::{Message, TaskStatus};
    use serde_json::json;

    #[test]
    fn the_reason_comes_from_the_status_part() {
        let mut task = Task::default();
        assert_eq!(status_reason(&task), None);
        task.status = TaskStatus::now(
            TaskState::Rejected,
            Some(Message::agent(vec![status_part(
                reasons::HANDOFF_CYCLE,
                json!({}),
            )])),
        );
        assert_eq!(status_reason(&task).as_deref(), Some("HANDOFF_CYCLE"));
    }

    #[test]
    fn a_report_is_the_root_node_in_camel_case() {
        let report = TraceReport {
            root: TraceNode {
                task_id: "t1".into(),
                context_id: "c1".into(),
                trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
                state: TaskState::Completed,
                agent: "echo".into(),
                created_at: DateTime::from_timestamp(1_000, 0).unwrap(),
                updated_at: None,
                parent_task_id: None,
                hops: vec![HopRecord {
                    agent: "echo".into(),
                    attempts: 1,
                    message_bytes: Some(42),
                    ..HopRecord::default()
                }],
                reason: None,
                children: Vec::new(),
            },
            truncated: false,
        };
        let value = serde_json::to_value(&report).unwrap();
        assert_eq!(value["taskId"], "t1");
        assert_eq!(value["traceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(value["state"], "TASK_STATE_COMPLETED");
        assert_eq!(value["hops"][0]["messageBytes"], 42);
        assert_eq!(value["children"], json!([]));
        assert!(value.get("truncated").is_none());
        let back: TraceReport = serde_json::from_value(value).unwrap();
        assert_eq!(back, report);
    }
}
