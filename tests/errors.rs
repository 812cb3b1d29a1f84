//! Every JSON-RPC error code over real HTTP, each asserted exactly (code,
//! HTTP status, id, error detail), and a table of malformed requests of which
//! none may create a task.

mod common;

use baton::auth::ANONYMOUS;
use baton::store::ListQuery;
use common::agents::{
    FailingAgent, GatedAgent, PlainAgent, SilentAgent, card, card_requiring_extension,
    card_with_unconfigured_extended_card,
};
use common::*;
use serde_json::{Value, json};

const ERROR_INFO: &str = "type.googleapis.com/google.rpc.ErrorInfo";
const BAD_REQUEST: &str = "type.googleapis.com/google.rpc.BadRequest";
const A2A_DOMAIN: &str = "a2a-protocol.org";

/// A reply as read off the wire, without assuming it is JSON.
struct Wire {
    status: u16,
    content_type: String,
    headers: reqwest::header::HeaderMap,
    text: String,
    body: Option<Value>,
}

impl Wire {
    fn describe(&self) -> String {
        format!("HTTP {} ({}) {}", self.status, self.content_type, self.text)
    }

    fn result(&self) -> &Value {
        let body = self
            .body
            .as_ref()
            .unwrap_or_else(|| panic!("expected JSON, got {}", self.describe()));
        assert_eq!(self.status, 200, "{}", self.describe());
        assert!(
            body.get("error").is_none(),
            "expected a result, got {}",
            self.describe()
        );
        &body["result"]
    }
}

/// Posts `body` to `path` with exactly `headers`.
async fn post(
    baton: &TestBaton,
    path: &str,
    body: impl Into<reqwest::Body>,
    headers: &[(&str, &str)],
) -> Wire {
    let mut request = baton.http.post(baton.url(path)).body(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = tokio::time::timeout(WAIT, request.send())
        .await
        .expect("reply in time")
        .expect("HTTP request");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = tokio::time::timeout(WAIT, response.text())
        .await
        .expect("body in time")
        .expect("body");
    let body = serde_json::from_str(&text).ok();
    Wire {
        status,
        content_type,
        headers,
        text,
        body,
    }
}

/// A JSON-RPC request body.
fn rpc(id: Value, method: &str, params: Value) -> String {
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string()
}

/// Posts a request with the standard A2A 1.0 headers.
async fn call(baton: &TestBaton, path: &str, id: Value, method: &str, params: Value) -> Wire {
    post(baton, path, rpc(id, method, params), &STANDARD_HEADERS).await
}

/// Checks that `wire` is a plain JSON JSON-RPC error reply with HTTP `status`
/// and `code`, whose `error` has only `code`, `message` and `data`, and whose
/// `data` entries (if any) each carry `@type`. Returns the `error` object.
fn check_error(wire: &Wire, status: u16, code: i64) -> Result<Value, String> {
    let fail = |what: &str| Err(format!("{what}; got {}", wire.describe()));
    if wire.status != status {
        return fail(&format!("expected HTTP {status}"));
    }
    if !wire.content_type.starts_with("application/json") {
        return fail("expected Content-Type application/json");
    }
    let Some(body) = &wire.body else {
        return fail("expected a JSON body");
    };
    if body["jsonrpc"] != "2.0" {
        return fail("expected jsonrpc \"2.0\"");
    }
    if body.get("result").is_some() {
        return fail("an error reply must not carry a result");
    }
    if body.get("id").is_none() {
        return fail("an error reply must carry an id (null when unknown)");
    }
    let Some(error) = body.get("error").and_then(Value::as_object) else {
        return fail("expected an error object");
    };
    if let Some(extra) = error
        .keys()
        .find(|k| !matches!(k.as_str(), "code" | "message" | "data"))
    {
        return fail(&format!("unexpected key {extra:?} in the error object"));
    }
    if error.get("code").and_then(Value::as_i64) != Some(code) {
        return fail(&format!("expected code {code}"));
    }
    if error
        .get("message")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        return fail("expected a non-empty message");
    }
    if let Some(data) = error.get("data") {
        let Some(entries) = data.as_array() else {
            return fail("data must be an array");
        };
        if entries.iter().any(|e| !e["@type"].is_string()) {
            return fail("every data entry must carry @type");
        }
    }
    Ok(Value::Object(error.clone()))
}

/// An A2A error (-32001…-32009) with its `google.rpc.ErrorInfo`.
fn check_a2a(wire: &Wire, code: i64, reason: &str) -> Result<Value, String> {
    let error = check_error(wire, 200, code)?;
    let info = &error["data"][0];
    if info["@type"] != ERROR_INFO || info["reason"] != reason || info["domain"] != A2A_DOMAIN {
        return Err(format!(
            "expected ErrorInfo {reason} in domain {A2A_DOMAIN}; got {}",
            wire.describe()
        ));
    }
    Ok(error)
}

/// -32602 with a `google.rpc.BadRequest` naming `field` (when given).
fn check_bad_request(wire: &Wire, status: u16, field: Option<&str>) -> Result<Value, String> {
    let error = check_error(wire, status, -32602)?;
    let detail = &error["data"][0];
    if detail["@type"] != BAD_REQUEST {
        return Err(format!(
            "expected a BadRequest detail; got {}",
            wire.describe()
        ));
    }
    let violations = detail["fieldViolations"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if violations.is_empty()
        || violations
            .iter()
            .any(|v| !v["field"].is_string() || !v["description"].is_string())
    {
        return Err(format!(
            "expected field violations with field and description; got {}",
            wire.describe()
        ));
    }
    if let Some(field) = field
        && !violations.iter().any(|v| v["field"] == field)
    {
        return Err(format!(
            "expected a violation of field {field:?}; got {}",
            wire.describe()
        ));
    }
    Ok(error)
}

fn must<T>(result: Result<T, String>) -> T {
    result.unwrap_or_else(|err| panic!("{err}"))
}

fn id_of(wire: &Wire) -> Value {
    wire.body.as_ref().map_or(Value::Null, |b| b["id"].clone())
}

/// A text message for `path`'s agent.
fn text_params(text: &str) -> Value {
    json!({"message": user_message(&message_id("m"), text)})
}

/// SendMessage to the echo agent; returns the id of the completed task.
async fn completed_task(baton: &TestBaton) -> String {
    let wire = call(baton, "/a2a", json!(1), "SendMessage", text_params("done")).await;
    let task = &wire.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED");
    task["id"].as_str().expect("task id").to_string()
}

/// ListTasks `totalSize` over HTTP, and the ledger's own count of tasks.
async fn task_counts(baton: &TestBaton) -> (i64, usize) {
    let wire = call(baton, "/a2a", json!("count"), "ListTasks", json!({})).await;
    let listed = wire.result()["totalSize"].as_i64().unwrap_or(-1);
    let page = baton
        .ledger
        .list(
            ANONYMOUS,
            &ListQuery {
                page_size: 100,
                ..ListQuery::default()
            },
        )
        .expect("ledger list");
    assert_eq!(page.total_size, page.records.len());
    (listed, page.records.len())
}

// ---------------------------------------------------------------------------
// (A) every JSON-RPC error code, each asserted exactly
// ---------------------------------------------------------------------------

#[tokio::test]
async fn malformed_json_is_32700_with_null_id() {
    let baton = baton().start().await;
    for body in [
        "{not json",
        "",
        "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"GetTask\"",
        "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"GetTask\"} trailing",
        "{\"jsonrpc\":\"2.0\",\"id\":\"a\",\"method\":\"GetTask\",}",
    ] {
        let wire = post(&baton, "/a2a", body, &STANDARD_HEADERS).await;
        must(check_error(&wire, 200, -32700).map_err(|e| format!("{body:?}: {e}")));
        assert_eq!(id_of(&wire), Value::Null, "{body:?}");
    }
    baton.stop().await;
}

#[tokio::test]
async fn invalid_requests_are_32600() {
    let baton = baton().start().await;
    // (body, the id the reply must carry)
    let cases = [
        // wrong or missing `jsonrpc`: the id is readable and echoed
        (
            r#"{"jsonrpc":"1.0","id":"s-1","method":"GetTask","params":{"id":"x"}}"#,
            json!("s-1"),
        ),
        (r#"{"jsonrpc":2.0,"id":4,"method":"GetTask"}"#, json!(4)),
        (
            r#"{"id":3,"method":"GetTask","params":{"id":"x"}}"#,
            json!(3),
        ),
        // missing or non-string `method`
        (r#"{"jsonrpc":"2.0","id":7,"params":{"id":"x"}}"#, json!(7)),
        (r#"{"jsonrpc":"2.0","id":"m","method":7}"#, json!("m")),
        (r#"{"jsonrpc":"2.0","id":"n","method":null}"#, json!("n")),
        // an id of a wrong type is unusable: null in the reply
        (
            r#"{"jsonrpc":"2.0","id":{"a":1},"method":"GetTask"}"#,
            Value::Null,
        ),
        (
            r#"{"jsonrpc":"2.0","id":true,"method":"GetTask"}"#,
            Value::Null,
        ),
        (
            r#"{"jsonrpc":"2.0","id":false,"method":"GetTask"}"#,
            Value::Null,
        ),
        (
            r#"{"jsonrpc":"2.0","id":[1],"method":"GetTask"}"#,
            Value::Null,
        ),
        // batches are not supported
        (
            r#"[{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":"x"}}]"#,
            Value::Null,
        ),
        ("[]", Value::Null),
        // JSON, but not an object
        ("42", Value::Null),
        ("\"GetTask\"", Value::Null),
        ("null", Value::Null),
    ];
    for (body, id) in cases {
        let wire = post(&baton, "/a2a", body, &STANDARD_HEADERS).await;
        must(check_error(&wire, 200, -32600).map_err(|e| format!("{body}: {e}")));
        assert_eq!(id_of(&wire), id, "{body}");
    }
    baton.stop().await;
}

#[tokio::test]
async fn unknown_methods_are_32601() {
    let baton = baton().start().await;
    for method in [
        "tasks/get",
        "message/send",
        "getTask",
        "sendmessage",
        "SendMessages",
    ] {
        let wire = call(&baton, "/a2a", json!(method), method, json!({"id": "x"})).await;
        must(check_error(&wire, 200, -32601).map_err(|e| format!("{method}: {e}")));
        assert_eq!(id_of(&wire), json!(method));
    }
    // The method is looked up before its params' tenant is.
    let params = json!({"id": "x", "tenant": "no-such-agent"});
    let wire = call(&baton, "/a2a", json!(1), "NoSuchMethod", params).await;
    must(check_error(&wire, 200, -32601));
    baton.stop().await;
}

#[tokio::test]
async fn invalid_params_are_32602_with_field_violations() {
    let baton = baton().start().await;
    let mut message = user_message(&message_id("m"), "x");
    message["parts"] = json!([]);
    let wire = call(
        &baton,
        "/a2a",
        json!(1),
        "SendMessage",
        json!({"message": message}),
    )
    .await;
    let error = must(check_bad_request(&wire, 200, Some("message.parts")));
    assert_eq!(error["data"][0]["@type"], BAD_REQUEST);
    assert_eq!(
        error["data"][0]["fieldViolations"][0]["field"],
        "message.parts"
    );

    let wire = call(&baton, "/a2a", json!(2), "GetTask", json!({"id": 5})).await;
    let error = must(check_bad_request(&wire, 200, Some("id")));
    assert_eq!(error["data"][0]["fieldViolations"][0]["field"], "id");

    // Several failing fields are all named.
    let wire = call(
        &baton,
        "/a2a",
        json!(3),
        "SendMessage",
        json!({"message": {"parts": []}}),
    )
    .await;
    must(check_bad_request(&wire, 200, Some("message.messageId")));
    must(check_bad_request(&wire, 200, Some("message.role")));
    must(check_bad_request(&wire, 200, Some("message.parts")));
    baton.stop().await;
}

#[tokio::test]
async fn agent_failing_before_any_task_is_32603() {
    let baton = baton()
        .agent("failing", FailingAgent(card("failing")))
        .start()
        .await;
    let path = "/agents/failing/a2a";
    let wire = call(&baton, path, json!("f1"), "SendMessage", text_params("hi")).await;
    let error = must(check_error(&wire, 200, -32603));
    assert!(error.get("data").is_none_or(|d| d.is_array()));
    assert_eq!(id_of(&wire), json!("f1"));

    // The streaming variant fails the same way, as plain JSON.
    let wire = call(
        &baton,
        path,
        json!("f2"),
        "SendStreamingMessage",
        text_params("hi"),
    )
    .await;
    must(check_error(&wire, 200, -32603));

    assert_eq!(task_counts(&baton).await, (0, 0), "no task may exist");
    baton.stop().await;
}

/// Fails its first execution, completes every later one.
struct FlakyAgent {
    card: baton::protocol::AgentCard,
    calls: std::sync::atomic::AtomicUsize,
    /// How long its first call takes to fail.
    fails_after: std::time::Duration,
}

#[async_trait::async_trait]
impl baton::agents::Agent for FlakyAgent {
    fn card(&self) -> &baton::protocol::AgentCard {
        &self.card
    }

    async fn execute(
        &self,
        _: baton::agents::AgentRequest,
        events: baton::agents::AgentEvents,
    ) -> Result<(), baton::agents::AgentError> {
        if self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(self.fails_after).await;
            return Err(baton::agents::AgentError::Failed("transient".into()));
        }
        events
            .status(baton::protocol::TaskState::Completed, None)
            .await;
        Ok(())
    }
}

const RETRY_HEADERS: [(&str, &str); 3] = [
    ("content-type", "application/json"),
    ("a2a-version", "1.0"),
    ("idempotency-key", "retry-1"),
];

/// -32603 is retryable, and a send that failed before any task existed
/// created nothing: repeating it with the same Idempotency-Key must reach the
/// agent again (DESIGN.md: a repeated send "returns what the first send
/// created"), not wait for a first send that has already ended.
#[tokio::test]
async fn a_send_failed_with_32603_can_be_retried_with_its_idempotency_key() {
    let flaky = FlakyAgent {
        card: card("flaky"),
        calls: std::sync::atomic::AtomicUsize::new(0),
        fails_after: std::time::Duration::ZERO,
    };
    let baton = baton().agent("flaky", flaky).start().await;
    let headers = RETRY_HEADERS;
    let params = text_params("hi");
    let body = rpc(json!(1), "SendMessage", params.clone());
    let wire = post(&baton, "/agents/flaky/a2a", body, &headers).await;
    must(check_error(&wire, 200, -32603));

    let started = std::time::Instant::now();
    let body = rpc(json!(2), "SendMessage", params);
    let wire = post(&baton, "/agents/flaky/a2a", body, &headers).await;
    let elapsed = started.elapsed();
    assert_eq!(
        wire.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED",
        "after {elapsed:?}"
    );
    assert!(elapsed < std::time::Duration::from_secs(2), "{elapsed:?}");
    baton.stop().await;
}

/// A repeat that arrives while the first send is still running, and that
/// send then fails before any task existed, runs again in its place.
#[tokio::test]
async fn a_repeat_waiting_on_a_send_that_fails_runs_again() {
    let flaky = FlakyAgent {
        card: card("flaky"),
        calls: std::sync::atomic::AtomicUsize::new(0),
        fails_after: std::time::Duration::from_millis(300),
    };
    let baton = std::sync::Arc::new(baton().agent("flaky", flaky).start().await);
    let params = text_params("hi");
    let first = {
        let (baton, params) = (baton.clone(), params.clone());
        tokio::spawn(async move {
            let body = rpc(json!(1), "SendMessage", params);
            post(&baton, "/agents/flaky/a2a", body, &RETRY_HEADERS).await
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    let body = rpc(json!(2), "SendMessage", params);
    let repeat = post(&baton, "/agents/flaky/a2a", body, &RETRY_HEADERS).await;
    let elapsed = started.elapsed();
    must(check_error(&first.await.unwrap(), 200, -32603));
    assert_eq!(
        repeat.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED",
        "after {elapsed:?}"
    );
    assert!(elapsed < std::time::Duration::from_secs(3), "{elapsed:?}");
    std::sync::Arc::into_inner(baton).unwrap().stop().await;
}

#[tokio::test]
async fn unknown_task_is_32001() {
    let baton = baton().start().await;
    let wire = call(&baton, "/a2a", json!(1), "GetTask", json!({"id": "nope"})).await;
    let error = must(check_a2a(&wire, -32001, "TASK_NOT_FOUND"));
    assert_eq!(error["data"][0]["metadata"]["taskId"], "nope");
    for method in ["CancelTask", "SubscribeToTask"] {
        let wire = call(&baton, "/a2a", json!(2), method, json!({"id": "nope"})).await;
        must(check_a2a(&wire, -32001, "TASK_NOT_FOUND").map_err(|e| format!("{method}: {e}")));
    }
    baton.stop().await;
}

#[tokio::test]
async fn canceling_a_completed_task_is_32002() {
    let baton = baton().start().await;
    let task_id = completed_task(&baton).await;
    let wire = call(
        &baton,
        "/a2a",
        json!(1),
        "CancelTask",
        json!({"id": task_id}),
    )
    .await;
    let error = must(check_a2a(&wire, -32002, "TASK_NOT_CANCELABLE"));
    assert_eq!(error["data"][0]["metadata"]["taskId"], json!(task_id));
    assert_eq!(
        error["data"][0]["metadata"]["state"],
        "TASK_STATE_COMPLETED"
    );
    baton.stop().await;
}

#[tokio::test]
async fn canceling_a_canceled_task_is_32002() {
    let gated = GatedAgent::new();
    let baton = baton().agent("gated", gated.clone()).start().await;
    let params = json!({
        "tenant": "gated",
        "message": user_message(&message_id("m"), "work"),
        "configuration": {"returnImmediately": true},
    });
    let wire = call(&baton, "/a2a", json!(1), "SendMessage", params).await;
    let task_id = wire.result()["task"]["id"].as_str().unwrap().to_string();
    let wire = call(
        &baton,
        "/a2a",
        json!(2),
        "CancelTask",
        json!({"id": task_id}),
    )
    .await;
    assert_eq!(wire.result()["status"]["state"], "TASK_STATE_CANCELED");

    let wire = call(
        &baton,
        "/a2a",
        json!(3),
        "CancelTask",
        json!({"id": task_id}),
    )
    .await;
    let error = must(check_a2a(&wire, -32002, "TASK_NOT_CANCELABLE"));
    assert_eq!(error["data"][0]["metadata"]["state"], "TASK_STATE_CANCELED");
    // A canceled task takes no more messages and cannot be subscribed to.
    let message = user_message_on(&task_id, &message_id("m"), "more");
    let wire = call(
        &baton,
        "/a2a",
        json!(4),
        "SendMessage",
        json!({"message": message}),
    )
    .await;
    must(check_a2a(&wire, -32004, "UNSUPPORTED_OPERATION"));
    let wire = call(
        &baton,
        "/a2a",
        json!(5),
        "SubscribeToTask",
        json!({"id": task_id}),
    )
    .await;
    must(check_a2a(&wire, -32004, "UNSUPPORTED_OPERATION"));
    gated.release(1);
    baton.stop().await;
}

#[tokio::test]
async fn push_methods_without_push_are_32003() {
    let baton = baton().without_push().start().await;
    let task_id = completed_task(&baton).await;
    let url = "http://127.0.0.1:9/hook";
    let cases = [
        (
            "CreateTaskPushNotificationConfig",
            json!({"taskId": task_id, "url": url}),
        ),
        (
            "GetTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": "c1"}),
        ),
        (
            "ListTaskPushNotificationConfigs",
            json!({"taskId": task_id}),
        ),
        (
            "DeleteTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": "c1"}),
        ),
    ];
    for (method, params) in cases {
        // Params that would not decode get the same answer.
        for params in [params, json!({"taskId": 5})] {
            let wire = call(&baton, "/a2a", json!(method), method, params).await;
            must(
                check_a2a(&wire, -32003, "PUSH_NOTIFICATION_NOT_SUPPORTED")
                    .map_err(|e| format!("{method}: {e}")),
            );
        }
    }
    // A push config inside SendMessage is refused too, before a task exists.
    let params = json!({
        "message": user_message(&message_id("m"), "x"),
        "configuration": {"taskPushNotificationConfig": {"url": url}},
    });
    let wire = call(&baton, "/a2a", json!(9), "SendMessage", params).await;
    must(check_a2a(&wire, -32003, "PUSH_NOTIFICATION_NOT_SUPPORTED"));
    assert_eq!(task_counts(&baton).await, (1, 1));
    baton.stop().await;
}

#[tokio::test]
async fn unsupported_operations_are_32004() {
    let baton = baton().agent("x", PlainAgent(card("x"))).start().await;
    let task_id = completed_task(&baton).await;

    // A message to a task in a terminal state.
    let message = user_message_on(&task_id, &message_id("m"), "more");
    for method in ["SendMessage", "SendStreamingMessage"] {
        let wire = call(
            &baton,
            "/a2a",
            json!(method),
            method,
            json!({"message": message}),
        )
        .await;
        must(
            check_a2a(&wire, -32004, "UNSUPPORTED_OPERATION").map_err(|e| format!("{method}: {e}")),
        );
    }

    // Subscribing to a terminal task: a plain JSON reply, not an SSE stream.
    let headers = [
        ("content-type", "application/json"),
        ("a2a-version", "1.0"),
        ("accept", "text/event-stream"),
    ];
    let body = rpc(json!("sub"), "SubscribeToTask", json!({"id": task_id}));
    let wire = post(&baton, "/a2a", body, &headers).await;
    assert!(
        !wire.content_type.starts_with("text/event-stream"),
        "{}",
        wire.describe()
    );
    must(check_a2a(&wire, -32004, "UNSUPPORTED_OPERATION"));
    assert_eq!(id_of(&wire), json!("sub"));

    // The extended card of an agent whose card does not declare one.
    let wire = call(
        &baton,
        "/agents/x/a2a",
        json!(3),
        "GetExtendedAgentCard",
        json!({}),
    )
    .await;
    must(check_a2a(&wire, -32004, "UNSUPPORTED_OPERATION"));
    baton.stop().await;
}

#[tokio::test]
async fn unsupported_content_is_32005() {
    let mut text_only = card("textonly");
    text_only.default_input_modes = vec!["text/plain".into()];
    let baton = baton()
        .agent("textonly", PlainAgent(text_only))
        .start()
        .await;

    // A part whose mediaType the agent does not accept.
    let message = json!({
        "messageId": message_id("m"),
        "role": "ROLE_USER",
        "parts": [{"text": "hi"}, {"raw": "iVBORw0KGgo=", "mediaType": "image/png"}],
    });
    for path in ["/agents/scenario/a2a", "/agents/textonly/a2a"] {
        let wire = call(
            &baton,
            path,
            json!(1),
            "SendMessage",
            json!({"message": message}),
        )
        .await;
        must(
            check_a2a(&wire, -32005, "CONTENT_TYPE_NOT_SUPPORTED")
                .map_err(|e| format!("{path}: {e}")),
        );
    }
    // The same via tenant on the gateway endpoint.
    let wire = call(
        &baton,
        "/a2a",
        json!(2),
        "SendMessage",
        json!({"tenant": "textonly", "message": message}),
    )
    .await;
    must(check_a2a(&wire, -32005, "CONTENT_TYPE_NOT_SUPPORTED"));

    // A request body that is not declared as JSON.
    let body = rpc(json!(3), "GetTask", json!({"id": "x"}));
    let wire = post(
        &baton,
        "/a2a",
        body,
        &[("content-type", "text/plain"), ("a2a-version", "1.0")],
    )
    .await;
    must(check_a2a(&wire, -32005, "CONTENT_TYPE_NOT_SUPPORTED"));

    assert_eq!(task_counts(&baton).await, (0, 0), "no task may exist");
    baton.stop().await;
}

#[tokio::test]
async fn agent_ending_without_a_reply_is_32006() {
    let baton = baton()
        .agent("silent", SilentAgent(card("silent")))
        .start()
        .await;
    let wire = call(
        &baton,
        "/agents/silent/a2a",
        json!(1),
        "SendMessage",
        text_params("hi"),
    )
    .await;
    let error = must(check_a2a(&wire, -32006, "INVALID_AGENT_RESPONSE"));
    assert_eq!(error["data"][0]["metadata"], json!({"agentId": "silent"}));
    assert_eq!(task_counts(&baton).await, (0, 0), "no task may exist");
    baton.stop().await;
}

/// An agent whose card declares an extended card Baton does not hold is
/// published without one, so asking for it is unsupported, not a promise
/// broken (-32007). (With keys: without, Baton offers no extended card.)
#[tokio::test]
async fn an_extended_card_baton_does_not_hold_is_not_offered() {
    let baton = baton()
        .agent("ext", PlainAgent(card_with_unconfigured_extended_card()))
        .api_keys("acme=KEY1")
        .start()
        .await;
    let card = baton.published_card("ext").await;
    assert_eq!(
        card["capabilities"].get("extendedAgentCard"),
        None,
        "{card}"
    );
    let mut headers = STANDARD_HEADERS.to_vec();
    headers.push(("authorization", "Bearer KEY1"));
    let body = rpc(json!(1), "GetExtendedAgentCard", json!({}));
    let wire = post(&baton, "/agents/ext/a2a", body, &headers).await;
    must(check_a2a(&wire, -32004, "UNSUPPORTED_OPERATION"));
    baton.stop().await;
}

#[tokio::test]
async fn required_extension_not_activated_is_32008() {
    let baton = baton()
        .agent("strict", PlainAgent(card_requiring_extension("urn:x")))
        .start()
        .await;
    let path = "/agents/strict/a2a";
    let wire = call(&baton, path, json!(1), "SendMessage", text_params("hi")).await;
    let error = must(check_a2a(&wire, -32008, "EXTENSION_SUPPORT_REQUIRED"));
    assert_eq!(error["data"][0]["metadata"]["extension"], "urn:x");

    // Addressed by tenant on the gateway endpoint, the agent's card rules.
    let params = json!({"tenant": "strict", "message": user_message(&message_id("m"), "hi")});
    let wire = call(&baton, "/a2a", json!(2), "SendMessage", params).await;
    must(check_a2a(&wire, -32008, "EXTENSION_SUPPORT_REQUIRED"));

    // Reached as the default agent, without naming it, its card rules too.
    let by_default = common::baton()
        .agent("strict", PlainAgent(card_requiring_extension("urn:x")))
        .default_agent("strict")
        .start()
        .await;
    let wire = call(
        &by_default,
        "/a2a",
        json!(5),
        "SendMessage",
        text_params("hi"),
    )
    .await;
    must(check_a2a(&wire, -32008, "EXTENSION_SUPPORT_REQUIRED"));
    assert_eq!(task_counts(&by_default).await, (0, 0), "no task may exist");
    by_default.stop().await;

    // An unrelated extension does not satisfy it.
    let headers = [
        ("content-type", "application/json"),
        ("a2a-version", "1.0"),
        ("a2a-extensions", "urn:other"),
    ];
    let body = rpc(json!(3), "SendMessage", text_params("hi"));
    let wire = post(&baton, path, body, &headers).await;
    must(check_a2a(&wire, -32008, "EXTENSION_SUPPORT_REQUIRED"));
    assert_eq!(task_counts(&baton).await, (0, 0), "no task may exist");

    // With the extension activated the send succeeds and the reply echoes it.
    let headers = [
        ("content-type", "application/json"),
        ("a2a-version", "1.0"),
        ("a2a-extensions", "urn:x"),
    ];
    let body = rpc(json!(4), "SendMessage", text_params("hi"));
    let wire = post(&baton, path, body, &headers).await;
    assert_eq!(
        wire.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    assert_eq!(
        wire.headers
            .get("a2a-extensions")
            .and_then(|v| v.to_str().ok()),
        Some("urn:x"),
        "{:?}",
        wire.headers
    );
    baton.stop().await;
}

#[tokio::test]
async fn unsupported_versions_are_32009() {
    let baton = baton().start().await;
    let body = || rpc(json!("v"), "GetTask", json!({"id": "x"}));
    let cases: [(&[(&str, &str)], &str); 4] = [
        (
            &[
                ("content-type", "application/json"),
                ("a2a-version", "99.0"),
            ],
            "99.0",
        ),
        (
            &[("content-type", "application/json"), ("a2a-version", "0.3")],
            "0.3",
        ),
        // No header: a 0.3 client, which Baton does not serve.
        (&[("content-type", "application/json")], "0.3"),
        // An empty value means 0.3 as well.
        (
            &[("content-type", "application/json"), ("a2a-version", "")],
            "0.3",
        ),
    ];
    for (headers, requested) in cases {
        let wire = post(&baton, "/a2a", body(), headers).await;
        let error = must(
            check_a2a(&wire, -32009, "VERSION_NOT_SUPPORTED")
                .map_err(|e| format!("{headers:?}: {e}")),
        );
        assert_eq!(error["data"][0]["metadata"]["requestedVersion"], requested);
        assert_eq!(id_of(&wire), json!("v"));
        // A request that named no version is told so, not that it asked for 0.3.
        let named = headers
            .iter()
            .any(|(name, value)| *name == "a2a-version" && !value.is_empty());
        let message = error["message"].as_str().unwrap_or_default();
        assert_eq!(
            message.contains("names no A2A version"),
            !named,
            "{message}"
        );
    }
    // By query parameter instead of the header.
    let headers = [("content-type", "application/json")];
    let wire = post(&baton, "/a2a?A2A-Version=99.0", body(), &headers).await;
    let error = must(check_a2a(&wire, -32009, "VERSION_NOT_SUPPORTED"));
    assert_eq!(error["data"][0]["metadata"]["requestedVersion"], "99.0");
    // Supported: 1.0 by header, by query parameter, and with a patch number.
    for (path, headers) in [
        ("/a2a", &STANDARD_HEADERS[..]),
        (
            "/a2a?A2A-Version=1.0",
            &[("content-type", "application/json")][..],
        ),
        (
            "/a2a",
            &[
                ("content-type", "application/json"),
                ("a2a-version", "1.0.3"),
            ][..],
        ),
    ] {
        let wire = post(&baton, path, body(), headers).await;
        must(
            check_a2a(&wire, -32001, "TASK_NOT_FOUND")
                .map_err(|e| format!("{path} {headers:?}: {e}")),
        );
    }
    baton.stop().await;
}

/// JSON-RPC 2.0 §5: the reply id MUST equal the request's id unless the id
/// could not be detected (parse error / invalid request). A request whose only
/// fault is its Content-Type has a perfectly readable id.
#[tokio::test]
async fn content_type_error_echoes_the_id() {
    let baton = baton().start().await;
    let body = rpc(json!("ct-1"), "GetTask", json!({"id": "x"}));
    let headers = [("content-type", "text/plain"), ("a2a-version", "1.0")];
    let wire = post(&baton, "/a2a", body, &headers).await;
    must(check_a2a(&wire, -32005, "CONTENT_TYPE_NOT_SUPPORTED"));
    assert_eq!(id_of(&wire), json!("ct-1"), "{}", wire.describe());
    baton.stop().await;
}

/// Baton speaks 1.0 only; a request for another `Major.Minor` (spec §3.6.2:
/// "matching Major.Minor") must be refused, while a patch number is ignored.
#[tokio::test]
async fn another_minor_version_is_32009() {
    let baton = baton().start().await;
    let body = rpc(json!("v"), "GetTask", json!({"id": "x"}));
    let headers = [("content-type", "application/json"), ("a2a-version", "1.1")];
    let wire = post(&baton, "/a2a", body, &headers).await;
    must(check_a2a(&wire, -32009, "VERSION_NOT_SUPPORTED"));
    baton.stop().await;
}

#[tokio::test]
async fn ids_keep_their_json_type() {
    let baton = baton().start().await;
    let task_id = completed_task(&baton).await;
    for id in [
        json!("abc-1"),
        json!("42"),
        json!(42),
        json!(-7),
        json!(0),
        json!(1.5),
        Value::Null,
    ] {
        // On success.
        let wire = call(
            &baton,
            "/a2a",
            id.clone(),
            "GetTask",
            json!({"id": task_id}),
        )
        .await;
        wire.result();
        assert_eq!(id_of(&wire), id, "success reply to id {id}");
        // On an A2A error.
        let wire = call(&baton, "/a2a", id.clone(), "GetTask", json!({"id": "nope"})).await;
        must(check_a2a(&wire, -32001, "TASK_NOT_FOUND"));
        assert_eq!(id_of(&wire), id, "error reply to id {id}");
        // On invalid params and an unknown method.
        let wire = call(&baton, "/a2a", id.clone(), "GetTask", json!({"id": 1})).await;
        must(check_bad_request(&wire, 200, Some("id")));
        assert_eq!(id_of(&wire), id, "invalid-params reply to id {id}");
        let wire = call(&baton, "/a2a", id.clone(), "NoSuchMethod", json!({})).await;
        must(check_error(&wire, 200, -32601));
        assert_eq!(id_of(&wire), id, "method-not-found reply to id {id}");
    }
    // The exact JSON type survives (a string of digits stays a string).
    let wire = call(
        &baton,
        "/a2a",
        json!("42"),
        "GetTask",
        json!({"id": "nope"}),
    )
    .await;
    assert!(wire.body.as_ref().unwrap()["id"].is_string());
    let wire = call(&baton, "/a2a", json!(42), "GetTask", json!({"id": "nope"})).await;
    assert!(wire.body.as_ref().unwrap()["id"].is_number());
    // Unparseable requests are answered with a null id.
    let wire = post(&baton, "/a2a", "{\"id\": 5, oops", &STANDARD_HEADERS).await;
    must(check_error(&wire, 200, -32700));
    assert!(wire.body.as_ref().unwrap()["id"].is_null());
    baton.stop().await;
}

/// JSON-RPC posts take a short way past the router (server `FrontDoor`);
/// any other method or path still reaches the router and its answers, and
/// the router alone answers JSON-RPC posts as the front door does.
#[tokio::test]
async fn json_rpc_posts_are_answered_alike_with_or_without_the_front_door() {
    for (label, builder) in [
        ("front door", baton()),
        ("router only", baton().router_only()),
    ] {
        let baton = builder.start().await;
        let body = || rpc(json!("g"), "GetTask", json!({"id": "x"}));
        for path in ["/a2a", "/agents/scenario/a2a"] {
            let get = baton.http.get(baton.url(path)).send().await.unwrap();
            assert_eq!(get.status().as_u16(), 405, "{label} {path}");
            assert_eq!(get.headers()["allow"], "POST", "{label} {path}");
        }
        let wire = post(&baton, "/a2a/more", body(), &STANDARD_HEADERS).await;
        assert_eq!(wire.status, 404, "{label}: {}", wire.describe());
        assert_eq!(wire.body, Some(json!({"error": "not found"})));
        let unversioned = [("content-type", "application/json")];
        for (path, headers) in [
            ("/a2a", &STANDARD_HEADERS[..]),
            ("/a2a/", &STANDARD_HEADERS[..]),
            ("/a2a?A2A-Version=1.0", &unversioned[..]),
            ("/agents/scenario/a2a", &STANDARD_HEADERS[..]),
            ("/agents/scenario/a2a/", &STANDARD_HEADERS[..]),
            // Percent-encoded ids are left to the router, which decodes them.
            ("/agents/sc%65nario/a2a", &STANDARD_HEADERS[..]),
        ] {
            let wire = post(&baton, path, body(), headers).await;
            must(
                check_a2a(&wire, -32001, "TASK_NOT_FOUND")
                    .map_err(|e| format!("{label} {path}: {e}")),
            );
        }
        let wire = post(&baton, "/agents/nope/a2a", body(), &STANDARD_HEADERS).await;
        must(check_bad_request(&wire, 404, None).map_err(|e| format!("{label}: {e}")));
        assert_eq!(
            id_of(&wire),
            json!("g"),
            "{label}: the answer names its request"
        );
        baton.stop().await;
    }
}

#[tokio::test]
async fn only_oversized_bodies_and_unknown_agents_leave_http_200() {
    let baton = baton().max_body_bytes(1024).start().await;

    // An oversized body: 413 with a JSON-RPC -32600 body.
    let params = json!({"message": user_message(&message_id("m"), &"x".repeat(8 * 1024))});
    let wire = call(&baton, "/a2a", json!(1), "SendMessage", params).await;
    must(check_error(&wire, 413, -32600));
    assert_eq!(id_of(&wire), Value::Null);

    // A body that cannot be read (a broken chunked encoding) is a bad
    // request, not an oversized one.
    let mut socket = tokio::net::TcpStream::connect(baton.base.trim_start_matches("http://"))
        .await
        .unwrap();
    let broken = "POST /a2a HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
                  A2A-Version: 1.0\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n";
    tokio::io::AsyncWriteExt::write_all(&mut socket, broken.as_bytes())
        .await
        .unwrap();
    let mut answer = String::new();
    let read = tokio::io::AsyncReadExt::read_to_string(&mut socket, &mut answer);
    // Baton answers and closes; a timeout would leave a partial answer.
    tokio::time::timeout(WAIT, read)
        .await
        .expect("the connection closes after the answer")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("-32600"), "{answer}");

    // An unknown agent path: 404 with a JSON-RPC -32602 body.
    let wire = call(
        &baton,
        "/agents/nope/a2a",
        json!(2),
        "GetTask",
        json!({"id": "x"}),
    )
    .await;
    must(check_bad_request(&wire, 404, None));
    assert_eq!(id_of(&wire), json!(2), "the answer names its request");
    // Whatever else is wrong with the request, the unknown agent is the error.
    let wire = post(
        &baton,
        "/agents/nope/a2a",
        "not a request",
        &STANDARD_HEADERS,
    )
    .await;
    must(check_bad_request(&wire, 404, None));
    assert_eq!(id_of(&wire), Value::Null);

    // An unknown agent by tenant is invalid params over HTTP 200.
    let wire = call(
        &baton,
        "/a2a",
        json!(3),
        "GetTask",
        json!({"id": "x", "tenant": "nope"}),
    )
    .await;
    must(check_bad_request(&wire, 200, Some("tenant")));

    // A body just under the limit is served normally.
    let wire = call(&baton, "/a2a", json!(4), "GetTask", json!({"id": "x"})).await;
    must(check_a2a(&wire, -32001, "TASK_NOT_FOUND"));
    assert_eq!(task_counts(&baton).await, (0, 0));
    baton.stop().await;
}

// ---------------------------------------------------------------------------
// (B) bad input: none creates a task
// ---------------------------------------------------------------------------

/// One malformed request and the exact answer it must get.
struct Row {
    path: &'static str,
    method: &'static str,
    params: Value,
    /// The JSON-RPC error code.
    code: i64,
    /// For -32602: a field that must be named in the BadRequest violations.
    /// For A2A errors: the ErrorInfo reason.
    detail: Option<&'static str>,
}

fn row(method: &'static str, params: Value, code: i64, detail: Option<&'static str>) -> Row {
    Row {
        path: "/a2a",
        method,
        params,
        code,
        detail,
    }
}

fn msg(extra: Value) -> Value {
    let mut message = user_message(&message_id("bad"), "x");
    merge(&mut message, extra);
    message
}

fn send(message: Value) -> Value {
    json!({"message": message})
}

/// An array nested `depth` levels deep.
fn nested(depth: usize) -> Value {
    (1..depth).fold(json!([]), |inner, _| json!([inner]))
}

#[tokio::test]
async fn the_deepest_data_taken_comes_back_in_replies_a_serde_client_reads() {
    let baton = baton().start().await;
    // 100 levels, written out: a lower limit fails here, a higher one in
    // the bad-input rows (101 is refused).
    let deepest = nested(100);
    let params = send(msg(json!({"parts": [{"data": deepest}]})));
    let wire = call(&baton, "/a2a", json!(1), "SendMessage", params).await;
    let task = &wire.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    // The reply held the data at its full depth, and parsed with serde_json's
    // default limit (`call` reads it so); so does GetTask's.
    assert_eq!(task["history"][0]["parts"][0]["data"], deepest);
    let wire = call(
        &baton,
        "/a2a",
        json!(2),
        "GetTask",
        json!({"id": task["id"]}),
    )
    .await;
    assert_eq!(wire.result()["history"][0]["parts"][0]["data"], deepest);
}

#[rustfmt::skip]
fn bad_input_rows() -> Vec<Row> {
    const P: i64 = -32602;
    let url = "https://example.com/hook";
    vec![
        // GetTask
        row("GetTask", json!({"id": 5}), P, Some("id")),
        row("GetTask", json!({}), P, Some("id")),
        row("GetTask", json!({"id": ""}), P, Some("id")),
        row("GetTask", json!({"id": "x", "historyLength": "abc"}), P, Some("historyLength")),
        row("GetTask", json!({"id": "x", "historyLength": -1}), P, Some("historyLength")),
        row("GetTask", json!({"id": "x", "historyLength": 2147483648_i64}), P, Some("historyLength")),
        row("GetTask", json!({"id": "x", "historyLength": 1e12}), P, Some("historyLength")),
        row("GetTask", json!({"id": "x", "historyLength": 1.5}), P, Some("historyLength")),
        row("GetTask", json!({"id": "x", "tenant": 5}), P, Some("tenant")),
        row("GetTask", json!({"id": "x", "tenant": "nope"}), P, Some("tenant")),
        // SendMessage: the message and its parts
        row("SendMessage", json!({"message": "hello"}), P, Some("message")),
        row("SendMessage", json!({}), P, Some("message")),
        row("SendMessage", json!({"message": null}), P, Some("message")),
        row("SendMessage", send(msg(json!({"parts": {"text": "x"}}))), P, Some("message.parts")),
        row("SendMessage", send(msg(json!({"parts": []}))), P, Some("message.parts")),
        row("SendMessage", send(msg(json!({"role": 99}))), P, Some("message.role")),
        row("SendMessage", send(msg(json!({"role": "ROLE_BOSS"}))), P, Some("message.role")),
        row("SendMessage", send(msg(json!({"role": "ROLE_UNSPECIFIED"}))), P, Some("message.role")),
        row("SendMessage", send(json!({"messageId": "m-no-role", "parts": [{"text": "x"}]})), P, Some("message.role")),
        row("SendMessage", send(json!({"role": "ROLE_USER", "parts": [{"text": "x"}]})), P, Some("message.messageId")),
        row("SendMessage", send(msg(json!({"messageId": ""}))), P, Some("message.messageId")),
        row("SendMessage", send(msg(json!({"messageId": 12}))), P, Some("message.messageId")),
        row("SendMessage", send(msg(json!({"contextId": 12}))), P, Some("message.contextId")),
        row("SendMessage", send(msg(json!({"parts": [{}]}))), P, Some("message.parts[0]")),
        row("SendMessage", send(msg(json!({"parts": [{"text": "x", "url": "https://example.com/a"}]}))), P, Some("message.parts[0]")),
        row("SendMessage", send(msg(json!({"parts": [{"text": "ok"}, {"raw": "!!not base64!!"}]}))), P, Some("message.parts[1].raw")),
        row("SendMessage", send(msg(json!({"parts": [{"url": ""}]}))), P, Some("message.parts[0].url")),
        row("SendMessage", send(msg(json!({"parts": [{"text": 5}]}))), P, Some("message.parts[0].text")),
        row("SendMessage", send(msg(json!({"parts": ["x"]}))), P, Some("message.parts[0]")),
        row("SendMessage", send(msg(json!({"metadata": "m"}))), P, Some("message.metadata")),
        row("SendMessage", send(msg(json!({"parts": [{"data": nested(101)}]}))), P, Some("message.parts[0].data")),
        row("SendMessage", send(msg(json!({"parts": [{"text": "x", "metadata": {"a": nested(100)}}]}))), P, Some("message.parts[0].metadata")),
        row("SendMessage", send(msg(json!({"metadata": {"a": nested(100)}}))), P, Some("message.metadata")),
        row("SendMessage", json!({"message": msg(json!({})), "configuration": {"historyLength": -1}}), P, Some("configuration.historyLength")),
        row("SendMessage", json!({"message": msg(json!({})), "configuration": {"historyLength": 2147483648_i64}}), P, Some("configuration.historyLength")),
        row("SendMessage", json!({"message": msg(json!({})), "configuration": "blocking"}), P, Some("configuration")),
        row("SendMessage", json!({"message": msg(json!({})), "configuration": {"taskPushNotificationConfig": {"url": "ftp://example.com/hook"}}}), P, Some("configuration.taskPushNotificationConfig.url")),
        row("SendMessage", json!({"message": msg(json!({})), "tenant": "nope"}), P, Some("tenant")),
        row("SendMessage", send(msg(json!({"taskId": "no-such-task"}))), -32001, Some("TASK_NOT_FOUND")),
        row("SendStreamingMessage", send(msg(json!({"parts": []}))), P, Some("message.parts")),
        row("SendStreamingMessage", json!({}), P, Some("message")),
        Row {
            path: "/agents/scenario/a2a",
            method: "SendMessage",
            params: send(msg(json!({"parts": [{"url": "https://example.com/a.png", "mediaType": "image/png"}]}))),
            code: -32005,
            detail: Some("CONTENT_TYPE_NOT_SUPPORTED"),
        },
        // ListTasks
        row("ListTasks", json!({"pageSize": true}), P, Some("pageSize")),
        row("ListTasks", json!({"pageSize": 0}), P, Some("pageSize")),
        row("ListTasks", json!({"pageSize": 101}), P, Some("pageSize")),
        row("ListTasks", json!({"pageSize": -1}), P, Some("pageSize")),
        row("ListTasks", json!({"pageSize": 2147483648_i64}), P, Some("pageSize")),
        row("ListTasks", json!({"pageSize": 1e12}), P, Some("pageSize")),
        row("ListTasks", json!({"historyLength": -1}), P, Some("historyLength")),
        row("ListTasks", json!({"historyLength": "abc"}), P, Some("historyLength")),
        row("ListTasks", json!({"status": "TASK_STATE_NOPE"}), P, Some("status")),
        row("ListTasks", json!({"status": 99}), P, Some("status")),
        row("ListTasks", json!({"statusTimestampAfter": "yesterday"}), P, Some("statusTimestampAfter")),
        row("ListTasks", json!({"statusTimestampAfter": 1700000000}), P, Some("statusTimestampAfter")),
        row("ListTasks", json!({"pageToken": "not-a-token"}), P, Some("pageToken")),
        row("ListTasks", json!({"pageToken": 7}), P, Some("pageToken")),
        row("ListTasks", json!({"includeArtifacts": "yes"}), P, Some("includeArtifacts")),
        row("ListTasks", json!({"contextId": 5}), P, Some("contextId")),
        // CancelTask and SubscribeToTask
        row("CancelTask", json!({}), P, Some("id")),
        row("CancelTask", json!({"id": ["x"]}), P, Some("id")),
        row("CancelTask", json!({"id": "no-such-task"}), -32001, Some("TASK_NOT_FOUND")),
        row("SubscribeToTask", json!({}), P, Some("id")),
        row("SubscribeToTask", json!({"id": "no-such-task"}), -32001, Some("TASK_NOT_FOUND")),
        // Push configs (the task "t" does not exist: validation comes first)
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t", "url": ""}), P, Some("url")),
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t"}), P, Some("url")),
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t", "url": "/hook"}), P, Some("url")),
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t", "url": "ftp://example.com/hook"}), P, Some("url")),
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t", "url": "http://"}), P, Some("url")),
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t", "url": 5}), P, Some("url")),
        row("CreateTaskPushNotificationConfig", json!({"url": url}), P, Some("taskId")),
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t", "url": url, "authentication": {"credentials": "c"}}), P, Some("authentication.scheme")),
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t", "url": url, "token": "t\r\nx-evil: 1"}), P, Some("token")),
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t", "url": "http://alice:secret@example.com/hook"}), P, Some("url")),
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t", "url": url, "authentication": {"scheme": "Bearer x, Basic", "credentials": "c"}}), P, Some("authentication.scheme")),
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t", "url": url, "authentication": {"scheme": "Bearer", "credentials": "c\n"}}), P, Some("authentication.credentials")),
        row("SendMessage", json!({"message": msg(json!({})), "configuration": {"taskPushNotificationConfig": {"url": url, "token": "\u{7f}"}}}), P, Some("configuration.taskPushNotificationConfig.token")),
        row("CreateTaskPushNotificationConfig", json!({"taskId": "t", "url": url}), -32001, Some("TASK_NOT_FOUND")),
        row("GetTaskPushNotificationConfig", json!({"id": "c1"}), P, Some("taskId")),
        row("GetTaskPushNotificationConfig", json!({"taskId": "t"}), P, Some("id")),
        row("ListTaskPushNotificationConfigs", json!({}), P, Some("taskId")),
        row("ListTaskPushNotificationConfigs", json!({"taskId": "t", "pageSize": "abc"}), P, Some("pageSize")),
        row("ListTaskPushNotificationConfigs", json!({"taskId": "t", "pageSize": -1}), P, Some("pageSize")),
        row("DeleteTaskPushNotificationConfig", json!({"id": "c1"}), P, Some("taskId")),
        row("DeleteTaskPushNotificationConfig", json!({"taskId": "t"}), P, Some("id")),
        // Params by position, which A2A's methods do not take
        row("GetTask", json!(["x"]), P, Some("params")),
        row("SendMessage", json!([msg(json!({}))]), P, Some("params")),
        // Params that are not structured: no valid request (JSON-RPC 2.0 §4.2)
        row("ListTasks", json!("all"), -32600, None),
        row("CancelTask", json!(5), -32600, None),
        row("GetExtendedAgentCard", json!(true), -32600, None),
        row("GetExtendedAgentCard", json!({"tenant": 5}), P, Some("tenant")),
        // Unknown methods
        row("message/send", send(msg(json!({}))), -32601, None),
        row("sendMessage", send(msg(json!({}))), -32601, None),
    ]
}

/// Runs one row; `Err` describes how the reply differs from the expectation.
async fn run_row(baton: &TestBaton, index: usize, row: &Row) -> Result<(), String> {
    let id = json!(format!("row-{index}"));
    let wire = call(baton, row.path, id.clone(), row.method, row.params.clone()).await;
    match (row.code, row.detail) {
        (-32602, field) => check_bad_request(&wire, 200, field).map(drop)?,
        (code, Some(reason)) if (-32099..=-32001).contains(&code) => {
            check_a2a(&wire, code, reason).map(drop)?
        }
        (code, _) => check_error(&wire, 200, code).map(drop)?,
    }
    if id_of(&wire) != id {
        return Err(format!("expected id {id}; got {}", wire.describe()));
    }
    Ok(())
}

#[tokio::test]
async fn bad_input_is_refused_and_none_creates_a_task() {
    let baton = baton().start().await;
    let rows = bad_input_rows();
    assert!(rows.len() >= 30, "only {} rows", rows.len());

    let mut failures = Vec::new();
    for (index, row) in rows.iter().enumerate() {
        if let Err(err) = run_row(&baton, index, row).await {
            failures.push(format!(
                "row {index}: {} {} {} -> expected {} {:?}: {err}",
                row.path, row.method, row.params, row.code, row.detail
            ));
        }
    }

    // None creates a task: neither ListTasks nor the ledger knows of one.
    let counts = task_counts(&baton).await;
    if counts != (0, 0) {
        failures.push(format!(
            "bad input created tasks: ListTasks totalSize {}, ledger {}",
            counts.0, counts.1
        ));
    }

    // Positive control: the same Baton does create a task on a valid request,
    // so the check above can fail.
    let wire = call(
        &baton,
        "/a2a",
        json!("ok"),
        "SendMessage",
        text_params("valid"),
    )
    .await;
    assert_eq!(
        wire.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    assert_eq!(
        task_counts(&baton).await,
        (1, 1),
        "the valid request made one task"
    );

    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
    baton.stop().await;
}
