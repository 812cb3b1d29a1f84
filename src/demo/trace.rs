//! The demo's trace printer: the gateway's `GET /tasks/{id}/trace` tree when
//! the gateway serves it, else the task's own timeline from `GetTask`. Kept
//! apart, and small, so that the `baton trace` printer can replace it.

use crate::protocol::{Message, PartContent, Task};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use std::time::Duration;

/// How long one trace or GetTask call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Prints the trace of gateway task `task_id` at the Baton at `base_url`.
pub async fn print_trace(base_url: &str, task_id: &str) {
    let client = match reqwest::Client::builder().timeout(CALL_TIMEOUT).build() {
        Ok(client) => client,
        Err(err) => return println!("  (no HTTP client: {err})"),
    };
    match fetch_trace(&client, base_url, task_id).await {
        Ok(tree) => print_node(&tree, None, 1),
        Err(why) => {
            println!("  ({why}; showing the task's timeline from GetTask)");
            match fetch_task(&client, base_url, task_id).await {
                Ok(task) => print_timeline(&task),
                Err(why) => println!("  (GetTask failed too: {why})"),
            }
        }
    }
}

async fn fetch_trace(client: &reqwest::Client, base: &str, task_id: &str) -> Result<Value, String> {
    let url = format!("{base}/tasks/{task_id}/trace");
    let response = client.get(&url).send().await.map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!(
            "GET /tasks/{{id}}/trace answered {}",
            response.status()
        ));
    }
    response
        .json()
        .await
        .map_err(|e| format!("trace is not JSON: {e}"))
}

async fn fetch_task(client: &reqwest::Client, base: &str, task_id: &str) -> Result<Task, String> {
    let reply: Value = client
        .post(format!("{base}/a2a"))
        .header("A2A-Version", crate::protocol::PROTOCOL_VERSION)
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": task_id}}))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    let result = reply
        .get("result")
        .ok_or_else(|| format!("no result: {}", reply["error"]))?;
    serde_json::from_value(result.clone()).map_err(|e| e.to_string())
}

/// One node of the trace tree and its children, hop times relative to the
/// root's first hop.
fn print_node(node: &Value, origin: Option<DateTime<Utc>>, depth: usize) {
    let indent = "  ".repeat(depth);
    let text = |field: &str| node[field].as_str().unwrap_or("?").to_owned();
    println!(
        "{indent}task {}  agent {}  {}",
        text("taskId"),
        text("agent"),
        text("state")
    );
    let hops = node["hops"].as_array().cloned().unwrap_or_default();
    let origin = origin.or_else(|| hops.first().and_then(|hop| time(&hop["startedAt"])));
    for hop in &hops {
        let offset = |field: &str| match (time(&hop[field]), origin) {
            (Some(at), Some(origin)) => format!("+{}ms", (at - origin).num_milliseconds()),
            _ => "-".into(),
        };
        let mut line = format!(
            "{indent}  {:<9} {:<10} started {:<7} acked {:<7} ended {:<7} {}",
            hop["kind"].as_str().unwrap_or("hop"),
            hop["agent"].as_str().unwrap_or("?"),
            offset("startedAt"),
            offset("ackedAt"),
            offset("endedAt"),
            hop["state"].as_str().unwrap_or(""),
        );
        if let Some(reason) = hop["reason"].as_str() {
            line.push_str(&format!("  reason {reason}"));
        }
        if let Some(attempts) = hop["attempts"].as_u64() {
            line.push_str(&format!("  attempts {attempts}"));
        }
        if let Some(bytes) = hop["messageBytes"].as_u64() {
            line.push_str(&format!("  {bytes} B"));
        }
        println!("{line}");
    }
    for child in node["children"].as_array().into_iter().flatten() {
        print_node(child, origin, depth + 1);
    }
}

fn time(value: &Value) -> Option<DateTime<Utc>> {
    value.as_str()?.parse().ok()
}

/// The task's history in order, then its current status.
fn print_timeline(task: &Task) {
    for message in &task.history {
        println!("  {:<10} {}", role(message), summary(message));
    }
    let at = task
        .status
        .timestamp
        .map(|at| at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default();
    let state = serde_json::to_value(task.status.state).unwrap_or_default();
    println!(
        "  {:<10} {} at {at}",
        "status",
        state.as_str().unwrap_or("?")
    );
}

fn role(message: &Message) -> String {
    let role = serde_json::to_value(message.role).unwrap_or_default();
    role.as_str()
        .unwrap_or("?")
        .trim_start_matches("ROLE_")
        .to_lowercase()
}

/// A message in one line: its text, and data parts by media type.
pub(crate) fn summary(message: &Message) -> String {
    let parts: Vec<String> = message
        .parts
        .iter()
        .map(|part| match &part.content {
            PartContent::Text(text) => format!("{text:?}"),
            PartContent::Data(data) if data.get("handoffId").is_some() => format!(
                "[handoff {}] {} → {}: {}",
                data["handoffId"].as_str().unwrap_or("?"),
                data["from"].as_str().unwrap_or("?"),
                data["to"]
                    .as_str()
                    .map(str::to_owned)
                    .or_else(|| data["toSkill"]
                        .as_str()
                        .map(|skill| format!("skill {skill}")))
                    .unwrap_or_else(|| "?".into()),
                data["goal"].as_str().unwrap_or("")
            ),
            PartContent::Data(data) => {
                let mut data = data.to_string();
                if data.len() > 90 {
                    let cut = (0..=90)
                        .rev()
                        .find(|i| data.is_char_boundary(*i))
                        .unwrap_or(0);
                    data.truncate(cut);
                    data.push('…');
                }
                format!("[{}] {data}", part.media_type)
            }
            PartContent::Url(url) => format!("[url] {url}"),
            PartContent::Raw(raw) => format!("[{} bytes]", raw.len()),
        })
        .collect();
    parts.join(" + ")
}
