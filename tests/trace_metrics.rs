//! `GET /metrics`, `GET /tasks/{taskId}/trace` and `baton trace` over real
//! HTTP: the Prometheus text, the handoff tree of tasks linked by
//! `parentTaskId`, and who may see it.

mod common;

use common::*;
use serde_json::{Value, json};
use std::process::{Command, Output};

/// A SendMessage of `message` to `path`, with extra headers; the task.
async fn send(b: &TestBaton, path: &str, message: Value, headers: &[(&str, &str)]) -> Value {
    let body =
        json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": message}});
    let headers = [&STANDARD_HEADERS[..], headers].concat();
    let reply = b.post_raw(path, body.to_string(), &headers).await;
    reply.result()["task"].clone()
}

/// A user message whose control metadata names `parent` as parent task.
fn child_message(message_id: &str, parent: &str) -> Value {
    let mut message = user_message(message_id, "work");
    message["metadata"] = json!({"urn:baton:handoff:v1": {"parentTaskId": parent}});
    message
}

/// `GET path` with extra headers: status, content type and body text.
async fn get(b: &TestBaton, path: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
    let mut request = b.http.get(b.url(path));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = tokio::time::timeout(WAIT, request.send())
        .await
        .expect("reply in time")
        .expect("HTTP request");
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    (status, content_type, response.text().await.expect("body"))
}

async fn get_json(b: &TestBaton, path: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let (status, _, body) = get(b, path, headers).await;
    let body = serde_json::from_str(&body).unwrap_or_else(|_| panic!("non-JSON {status}: {body}"));
    (status, body)
}

fn id(task: &Value) -> String {
    task["id"].as_str().expect("task id").to_string()
}

#[tokio::test]
async fn metrics_are_prometheus_text_without_a_key() {
    let b = baton().api_keys("acme=KEY1").start().await;
    b.gateway
        .metrics
        .handoff_started("", "echo", baton::store::HopKind::Call);
    let (status, content_type, text) = get(&b, "/metrics", &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
    for line in [
        "# TYPE baton_handoffs_total counter",
        "# TYPE baton_handoff_outcomes_total counter",
        "# TYPE baton_handoff_rejections_total counter",
        "# TYPE baton_handoff_ack_seconds histogram",
        "# TYPE baton_task_transition_seconds histogram",
        "# TYPE baton_agent_round_trip_seconds histogram",
        "# TYPE baton_handoff_hop_depth histogram",
        "# TYPE baton_handoff_message_bytes histogram",
        "# TYPE baton_handoff_ladder_steps_total counter",
        "# TYPE baton_registered_agents gauge",
        "# TYPE baton_ledger_durable_writes_total counter",
        "# TYPE baton_ledger_log_syncs_total counter",
        r#"baton_handoffs_total{source="client",target="echo",kind="call"} 1"#,
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} missing:\n{text}");
    }
    let agents = sample(&text, "baton_registered_agents");
    assert!(agents >= 2, "echo and scenario are built in: {agents}");
    b.stop().await;
}

#[tokio::test]
async fn a_handoff_from_an_unregistered_agent_is_counted_under_one_label() {
    let b = baton().start().await;
    // `from` is the caller's word: a thousand made-up senders must not
    // become a thousand series kept until restart.
    let made_up = format!("vendor-{}", "x".repeat(4096));
    for from in [made_up.as_str(), "scenario"] {
        let payload = handoff_payload(from, json!({"to": "echo"}), json!({}));
        let reply = b
            .call("SendMessage", json!({"message": handoff_message(payload)}))
            .await;
        let state = &reply.result()["task"]["status"]["state"];
        assert_eq!(state, "TASK_STATE_COMPLETED", "from {from:.20}");
    }
    let (status, _, text) = get(&b, "/metrics", &[]).await;
    assert_eq!(status, 200, "{text}");
    for line in [
        r#"baton_handoffs_total{source="unregistered",target="echo",kind="direct"} 1"#,
        r#"baton_handoffs_total{source="scenario",target="echo",kind="direct"} 1"#,
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} missing:\n{text}");
    }
    assert!(
        !text.contains("vendor-"),
        "the made-up sender became a label"
    );
    b.stop().await;
}

/// Every state change is timed, whoever makes it: the agent (an answer
/// resuming a task that waited for input), or the gateway (a cancel).
#[tokio::test]
async fn state_changes_are_timed_whoever_makes_them() {
    let gated = common::agents::GatedAgent::new();
    let b = baton()
        .agent("gated", gated.clone())
        .default_agent("scenario")
        .start()
        .await;
    let params = json!({
        "message": user_message(&message_id("m"), "long job"),
        "configuration": {"returnImmediately": true},
    });
    let held = b.call_at("/agents/gated/a2a", "SendMessage", params).await;
    let held = held.result()["task"]["id"].clone();
    let canceled = b.call("CancelTask", json!({"id": held})).await;
    assert_eq!(canceled.result()["status"]["state"], "TASK_STATE_CANCELED");
    let asked = b
        .send_text(&message_id("tck-input-required"), "ask", json!({}))
        .await;
    let answer = user_message_on(&asked["task"]["id"], &message_id("tck-complete-task"), "ok");
    let done = b.call("SendMessage", json!({"message": answer})).await;
    assert_eq!(
        done.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    let (status, _, text) = get(&b, "/metrics", &[]).await;
    assert_eq!(status, 200, "{text}");
    let counts = transition_counts(&text);
    // A blocking reply comes once its write is durable, and the write was
    // counted before that.
    let expected = [
        r#"{from="TASK_STATE_INPUT_REQUIRED",to="TASK_STATE_WORKING"} 1"#,
        r#"{from="TASK_STATE_WORKING",to="TASK_STATE_COMPLETED"} 1"#,
        r#"{from="TASK_STATE_WORKING",to="TASK_STATE_CANCELED"} 1"#,
    ];
    assert_eq!(counts.len(), expected.len(), "{counts:#?}");
    for series in expected {
        assert!(counts.contains(&series), "{series} missing: {counts:#?}");
    }
    gated.release(1);
    b.stop().await;
}

/// A counter's or gauge's sample in a Prometheus text.
fn sample(text: &str, name: &str) -> u64 {
    baton::metrics::sample_value(text, name)
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no sample of {name}:\n{text}"))
}

#[tokio::test]
async fn metrics_count_the_ledgers_durable_writes_and_log_syncs() {
    let b = baton().start().await;
    for _ in 0..3 {
        let task = send(&b, "/a2a", user_message(&message_id("m"), "hi"), &[]).await;
        assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    }
    let (status, _, text) = get(&b, "/metrics", &[]).await;
    assert_eq!(status, 200, "{text}");
    let writes = sample(&text, "baton_ledger_durable_writes_total");
    let syncs = sample(&text, "baton_ledger_log_syncs_total");
    // Each completed send was durable before its reply; groups hold one
    // write or more.
    assert!(writes >= 3, "{writes} durable writes");
    assert!(
        (1..=writes).contains(&syncs),
        "{syncs} syncs for {writes} writes"
    );
    b.stop().await;
}

#[tokio::test]
async fn the_trace_is_the_tree_of_tasks_below() {
    let b = baton().start().await;
    let root = send(&b, "/a2a", user_message(&message_id("m"), "hello"), &[]).await;
    assert_eq!(root["status"]["state"], "TASK_STATE_COMPLETED");
    let root_id = id(&root);
    // A child at another agent, then a grandchild back at echo: a cycle.
    let child = send(
        &b,
        "/agents/scenario/a2a",
        child_message(&message_id("tck-complete-task"), &root_id),
        &[],
    )
    .await;
    let child_id = id(&child);
    let grandchild = send(
        &b,
        "/agents/echo/a2a",
        child_message(&message_id("m"), &child_id),
        &[],
    )
    .await;
    assert_eq!(grandchild["status"]["state"], "TASK_STATE_REJECTED");
    let unrelated = send(&b, "/a2a", user_message(&message_id("m"), "other"), &[]).await;

    let (status, trace) = get_json(&b, &format!("/tasks/{root_id}/trace"), &[]).await;
    assert_eq!(status, 200, "{trace}");
    assert_eq!(trace["taskId"], root_id.as_str());
    assert_eq!(trace["contextId"], root["contextId"]);
    assert_eq!(trace["agent"], "echo");
    assert_eq!(trace["state"], "TASK_STATE_COMPLETED");
    assert!(trace["createdAt"].as_str().is_some(), "{trace}");
    assert!(trace["hops"].is_array(), "{trace}");
    let trace_id = trace["traceId"].as_str().expect("trace id");
    assert_eq!(trace_id.len(), 32, "{trace}");
    assert_eq!(
        trace_id, root["metadata"]["urn:baton:handoff:v1"]["traceId"],
        "the trace id of the task's control metadata"
    );

    let children = trace["children"].as_array().expect("children");
    assert_eq!(children.len(), 1, "only the linked task: {trace}");
    let child = &children[0];
    assert_eq!(child["taskId"], child_id.as_str());
    assert_eq!(child["agent"], "scenario");
    assert_eq!(child["state"], "TASK_STATE_COMPLETED");
    assert_eq!(child["parentTaskId"], root_id.as_str());
    assert_eq!(child["traceId"], trace_id, "one line of work, one trace");
    let grandchildren = child["children"].as_array().expect("grandchildren");
    assert_eq!(grandchildren.len(), 1, "{trace}");
    assert_eq!(grandchildren[0]["taskId"], id(&grandchild).as_str());
    assert_eq!(grandchildren[0]["state"], "TASK_STATE_REJECTED");
    assert_eq!(grandchildren[0]["reason"], "HANDOFF_CYCLE");
    assert_eq!(grandchildren[0]["children"], json!([]));
    assert!(!trace.to_string().contains(&id(&unrelated)));

    // A trace may start anywhere in the graph.
    let (status, below) = get_json(&b, &format!("/tasks/{child_id}/trace"), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(below["taskId"], child_id.as_str());
    assert_eq!(below["children"].as_array().map(Vec::len), Some(1));
    b.stop().await;
}

#[tokio::test]
async fn an_unknown_task_has_no_trace() {
    let b = baton().start().await;
    let (status, body) = get_json(&b, "/tasks/no-such-task/trace", &[]).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], -32001);
    b.stop().await;
}

#[tokio::test]
async fn with_keys_a_trace_needs_the_owners_key() {
    let b = baton().api_keys("acme=KEY1,globex=KEY2").start().await;
    let acme = [("authorization", "Bearer KEY1")];
    let task = send(&b, "/a2a", user_message(&message_id("m"), "hi"), &acme).await;
    let path = format!("/tasks/{}/trace", id(&task));

    let (status, body) = get_json(&b, &path, &[]).await;
    assert_eq!(status, 401, "{body}");
    let (status, _) = get_json(&b, &path, &[("authorization", "Bearer WRONG")]).await;
    assert_eq!(status, 401);
    let (status, body) = get_json(&b, &path, &[("authorization", "Bearer KEY2")]).await;
    assert_eq!(status, 404, "another principal's task is not found: {body}");
    assert_eq!(body["error"]["code"], -32001);
    let (status, body) = get_json(&b, &path, &acme).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["taskId"], task["id"]);
    b.stop().await;
}

#[tokio::test]
async fn a_child_naming_another_principals_task_is_not_linked_under_it() {
    let b = baton().api_keys("acme=KEY1,globex=KEY2").start().await;
    let acme = [("authorization", "Bearer KEY1")];
    let globex = [("authorization", "Bearer KEY2")];
    let root = send(&b, "/a2a", user_message(&message_id("m"), "hi"), &acme).await;
    let root_id = id(&root);
    let under_root = |mut message: Value| {
        message["metadata"] = json!({"urn:baton:handoff:v1": {"parentTaskId": root_id}});
        message
    };
    // globex names acme's task as parent: a plain call, a direct handoff,
    // and a handoff refused for its unknown target.
    let handoff = |to: &str| {
        under_root(handoff_message(handoff_payload(
            "scenario",
            json!({"to": to}),
            json!({}),
        )))
    };
    for (message, state) in [
        (
            child_message(&message_id("m"), &root_id),
            "TASK_STATE_COMPLETED",
        ),
        (handoff("echo"), "TASK_STATE_COMPLETED"),
        (handoff("payroll"), "TASK_STATE_REJECTED"),
    ] {
        let task = send(&b, "/a2a", message, &globex).await;
        assert_eq!(task["status"]["state"], state, "{task}");
    }
    // acme's own child is linked.
    let own = send(&b, "/a2a", child_message(&message_id("m"), &root_id), &acme).await;

    let (status, trace) = get_json(&b, &format!("/tasks/{root_id}/trace"), &acme).await;
    assert_eq!(status, 200, "{trace}");
    let children: Vec<&Value> = trace["children"]
        .as_array()
        .expect("children")
        .iter()
        .collect();
    assert_eq!(children.len(), 1, "only acme's own child: {trace}");
    assert_eq!(children[0]["taskId"], own["id"]);
    b.stop().await;
}

/// Runs `baton ARGS` with `env` as its only `BATON_*` settings, off the
/// runtime thread so the in-process server keeps answering.
async fn baton_cli(args: Vec<String>, env: Vec<(&'static str, String)>) -> Output {
    tokio::task::spawn_blocking(move || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_baton"));
        command.args(&args);
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("BATON_") {
                command.env_remove(name);
            }
        }
        command.envs(env);
        command.output().expect("the baton binary runs")
    })
    .await
    .expect("the command finishes")
}

#[tokio::test]
async fn baton_trace_prints_the_chain() {
    let b = baton().api_keys("acme=KEY1").start().await;
    let acme = [("authorization", "Bearer KEY1")];
    let root = send(&b, "/a2a", user_message(&message_id("m"), "hi"), &acme).await;
    let root_id = id(&root);
    let child = send(
        &b,
        "/agents/scenario/a2a",
        child_message(&message_id("tck-complete-task"), &root_id),
        &acme,
    )
    .await;
    let key = || vec![("BATON_API_KEY", "KEY1".to_string())];
    let trace = |extra: &[&str]| {
        let mut args = vec![
            "trace".to_string(),
            root_id.clone(),
            "--url".into(),
            b.base.clone(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        args
    };

    let output = baton_cli(trace(&[]), key()).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("trace "), "{stdout}");
    assert!(
        lines[1].starts_with(&format!("task {root_id}  agent echo  COMPLETED")),
        "{stdout}"
    );
    let child_line = format!("└─ task {}  agent scenario  COMPLETED", id(&child));
    assert!(
        lines
            .iter()
            .any(|l| l.trim_start().starts_with(&child_line)),
        "{stdout}"
    );

    let output = baton_cli(trace(&["--json"]), key()).await;
    assert!(output.status.success());
    let report: Value = serde_json::from_slice(&output.stdout).expect("--json prints JSON");
    assert_eq!(report["taskId"], root_id.as_str());
    assert_eq!(report["children"][0]["agent"], "scenario");

    let output = baton_cli(trace(&[]), Vec::new()).await;
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with("unauthorized:") && stderr.contains("BATON_API_KEY"),
        "{stderr}"
    );

    let mut unknown = trace(&[]);
    unknown[1] = "no-such-task".into();
    let output = baton_cli(unknown, key()).await;
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("404"), "{stderr}");
    b.stop().await;
}
