//! `baton trace TASK_ID`: asks a running Baton for the handoff tree below a
//! task (`GET {url}/tasks/{taskId}/trace`) and prints it as an indented tree,
//! one table of hops per task; `--json` prints the report as it came. A
//! failure goes to standard error with exit code 1.

use super::TraceArgs;
use crate::gateway::{TraceNode, TraceReport};
use crate::protocol::TaskState;
use crate::protocol::wire::ProtoEnum as _;
use crate::registry_client::ClientError;
use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::Value;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

/// How long the call may take.
const TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `baton trace`.
pub async fn run(args: TraceArgs) -> ExitCode {
    match fetch(&args.url, &args.task_id, args.key).await {
        Ok(report) if args.json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Ok(report) => match serde_json::from_value::<TraceReport>(report) {
            Ok(report) => {
                print!("{}", render(&report));
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("{}", ClientError::BadReply(format!("not a trace: {err}")));
                ExitCode::FAILURE
            }
        },
        Err(err) => {
            eprintln!("{err}");
            ExitCode::FAILURE
        }
    }
}

/// The trace URL of `task_id` under Baton's `base_url`.
fn trace_url(base_url: &str, task_id: &str) -> Result<reqwest::Url, ClientError> {
    let bad = || ClientError::BadUrl(base_url.to_string());
    let mut url = reqwest::Url::parse(base_url.trim()).map_err(|_| bad())?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err(bad());
    }
    // Segments are percent-encoded, so any task id stays one segment.
    url.path_segments_mut()
        .map_err(|_| bad())?
        .pop_if_empty()
        .extend(["tasks", task_id, "trace"]);
    Ok(url)
}

/// `GET` the trace; the report as JSON.
async fn fetch(base_url: &str, task_id: &str, key: Option<String>) -> Result<Value, ClientError> {
    let url = trace_url(base_url, task_id)?;
    let transport = |source| ClientError::Transport {
        url: url.to_string(),
        source,
    };
    let http = reqwest::Client::builder()
        .timeout(TIMEOUT)
        .build()
        .map_err(transport)?;
    let key = key.filter(|k| !k.trim().is_empty());
    let mut request = http.get(url.clone());
    if let Some(key) = &key {
        request = request.bearer_auth(key.trim());
    }
    let response = request.send().await.map_err(transport)?;
    let status = response.status();
    let body = response.bytes().await.map_err(transport)?;
    let reply: Option<Value> = serde_json::from_slice(&body).ok();
    let error_message = reply
        .as_ref()
        .and_then(|r| r.get("error"))
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .map(str::to_string);
    if status == reqwest::StatusCode::UNAUTHORIZED {
        let hint = if key.is_none() {
            " (no key given: pass --key or set BATON_API_KEY)"
        } else {
            ""
        };
        let message = error_message.unwrap_or_else(|| "HTTP 401".into());
        return Err(ClientError::Unauthorized(format!("{message}{hint}")));
    }
    if !status.is_success() {
        return Err(ClientError::Http {
            status: status.as_u16(),
            body: error_message.unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned()),
        });
    }
    reply.ok_or_else(|| ClientError::BadReply("the trace is not JSON".into()))
}

/// The report as an indented tree: a header line per task, then its hops as
/// a table; children one level deeper.
pub fn render(report: &TraceReport) -> String {
    let mut out = String::new();
    let root = &report.root;
    let _ = writeln!(
        out,
        "trace {}  context {}",
        root.trace_id.as_deref().unwrap_or("-"),
        root.context_id
    );
    render_node(&mut out, root, None, 0);
    if report.truncated {
        let _ = writeln!(
            out,
            "(truncated: the trace stops at {} levels or {} tasks)",
            crate::gateway::MAX_TRACE_DEPTH,
            crate::gateway::MAX_TRACE_NODES
        );
    }
    out
}

fn render_node(out: &mut String, node: &TraceNode, parent: Option<&TraceNode>, depth: usize) {
    // A child's marker sits under its parent's hop table, its text 5 columns in.
    let (indent, marker) = match depth {
        0 => (String::new(), ""),
        _ => (" ".repeat(5 * depth - 3), "└─ "),
    };
    let _ = write!(
        out,
        "{indent}{marker}task {}  agent {}  {}",
        node.task_id,
        node.agent,
        state_name(node.state)
    );
    if let Some(reason) = &node.reason {
        let _ = write!(out, "  reason {reason}");
    }
    let _ = write!(out, "  created {}", timestamp(node.created_at));
    if let Some(parent) = parent {
        if node.context_id != parent.context_id {
            let _ = write!(out, "  context {}", node.context_id);
        }
        if node.trace_id != parent.trace_id {
            let _ = write!(out, "  trace {}", node.trace_id.as_deref().unwrap_or("-"));
        }
    }
    out.push('\n');
    let body_indent = " ".repeat(5 * depth + 2);
    if node.hops.is_empty() {
        let _ = writeln!(out, "{body_indent}(no hops recorded)");
    } else {
        render_hops(out, node, &body_indent);
    }
    for child in &node.children {
        render_node(out, child, Some(node), depth + 1);
    }
}

const HOP_COLUMNS: [&str; 10] = [
    "#", "AGENT", "KIND", "STATE", "STARTED", "ACK", "ENDED", "ATTEMPTS", "REASON", "BYTES",
];

fn render_hops(out: &mut String, node: &TraceNode, indent: &str) {
    let rows: Vec<[String; 10]> = node
        .hops
        .iter()
        .enumerate()
        .map(|(i, hop)| {
            [
                (i + 1).to_string(),
                hop.agent.clone(),
                serde_json::to_value(hop.kind)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                hop.state.map_or("-".into(), state_name),
                timestamp(hop.started_at),
                offset(hop.started_at, hop.acked_at),
                offset(hop.started_at, hop.ended_at),
                hop.attempts.to_string(),
                hop.reason.clone().unwrap_or_else(|| "-".into()),
                hop.message_bytes.map_or("-".into(), |b| b.to_string()),
            ]
        })
        .collect();
    let mut widths = HOP_COLUMNS.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let header = HOP_COLUMNS.map(str::to_string);
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = indent.to_string();
        for (i, (cell, width)) in row.iter().zip(widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<width$}  ");
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
}

/// `COMPLETED` for `TASK_STATE_COMPLETED`: the table is for reading.
fn state_name(state: TaskState) -> String {
    let name = state.proto_name();
    name.strip_prefix("TASK_STATE_").unwrap_or(name).to_string()
}

fn timestamp(time: DateTime<Utc>) -> String {
    time.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// `+12ms` after `start`, or `-` when it has not happened.
fn offset(start: DateTime<Utc>, at: Option<DateTime<Utc>>) -> String {
    at.map_or("-".into(), |at| {
        format!("+{}ms", (at - start).num_milliseconds())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{HopKind, HopRecord};

    fn at(millis: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_790_000_000_000 + millis).unwrap()
    }

    fn node(id: &str, agent: &str, state: TaskState) -> TraceNode {
        TraceNode {
            task_id: id.into(),
            context_id: "ctx-1".into(),
            trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
            state,
            agent: agent.into(),
            created_at: at(0),
            updated_at: None,
            parent_task_id: None,
            hops: Vec::new(),
            reason: None,
            children: Vec::new(),
        }
    }

    #[test]
    fn urls() {
        assert_eq!(
            trace_url("http://localhost:8080", "t-1").unwrap().as_str(),
            "http://localhost:8080/tasks/t-1/trace"
        );
        assert_eq!(
            trace_url("http://h/base/", "a/b").unwrap().as_str(),
            "http://h/base/tasks/a%2Fb/trace"
        );
        for bad in ["localhost:8080", "ftp://x", ""] {
            assert!(
                matches!(trace_url(bad, "t"), Err(ClientError::BadUrl(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_tree_shows_hops_and_children() {
        let mut root = node("t-root", "triage", TaskState::Working);
        root.hops = vec![
            HopRecord {
                agent: "triage".into(),
                kind: HopKind::Call,
                started_at: at(0),
                acked_at: Some(at(12)),
                ended_at: Some(at(340)),
                state: Some(TaskState::Completed),
                attempts: 1,
                message_bytes: Some(1234),
                ..HopRecord::default()
            },
            HopRecord {
                agent: "billing".into(),
                kind: HopKind::Transfer,
                started_at: at(400),
                attempts: 2,
                reason: Some("RETRY".into()),
                ..HopRecord::default()
            },
        ];
        let mut child = node("t-child", "refunds", TaskState::Rejected);
        child.reason = Some("HANDOFF_CYCLE".into());
        child.context_id = "ctx-2".into();
        root.children.push(child);
        let text = render(&TraceReport {
            root,
            truncated: true,
        });
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "trace 4bf92f3577b34da6a3ce929d0e0e4736  context ctx-1"
        );
        assert!(
            lines[1].starts_with("task t-root  agent triage  WORKING  created 2026-"),
            "{text}"
        );
        assert!(
            lines[2].starts_with("  #  AGENT    KIND      STATE"),
            "{text}"
        );
        assert!(
            lines[3].contains("triage   call      COMPLETED")
                && lines[3].contains("+12ms")
                && lines[3].contains("+340ms")
                && lines[3].ends_with("1234"),
            "{text}"
        );
        assert!(
            lines[4].contains("billing  transfer  -") && lines[4].contains("RETRY"),
            "{text}"
        );
        assert!(
            lines[5]
                .starts_with("  └─ task t-child  agent refunds  REJECTED  reason HANDOFF_CYCLE")
                && lines[5].ends_with("context ctx-2"),
            "{text}"
        );
        assert_eq!(lines[6], "       (no hops recorded)");
        assert!(lines[7].starts_with("(truncated"), "{text}");
    }
}
