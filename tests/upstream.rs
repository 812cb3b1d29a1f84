//! Remote A2A agents over real HTTP: one Baton is the upstream (its
//! `/agents/{id}/a2a` endpoints are real A2A 1.0 agents), a second Baton is
//! the gateway proxying to it through a `RemoteAgent`. Covers forwarding
//! under gateway ids, streaming fan-out, polling, multi-turn, cancel, the
//! ledger outliving the upstream, each upstream fault, and recovery.

mod common;

use axum::http::{HeaderMap, StatusCode, header};
use baton::agents::{Agent, AgentError, AgentEvent, AgentEvents, UpstreamRef};
use baton::gateway::GatewaySettings;
use baton::netguard::OutboundPolicy;
use baton::protocol::{AgentCard, Task, TaskState, TaskStatus};
use baton::upstream::{RemoteAgent, UpstreamSettings};
use common::agents::{ChattyAgent, GatedAgent, card};
use common::*;
use serde_json::{Value, json};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Loopback is where every agent of these tests lives.
fn loopback() -> OutboundPolicy {
    OutboundPolicy {
        allow: vec!["127.0.0.0/8".parse().unwrap()],
        ..OutboundPolicy::default()
    }
}

/// The card `upstream` publishes for `agent`, declaring streaming or not.
async fn published_card(upstream: &TestBaton, agent: &str, streaming: bool) -> AgentCard {
    let url = upstream.url(&format!("/agents/{agent}/.well-known/agent-card.json"));
    let response = tokio::time::timeout(WAIT, upstream.http.get(url).send())
        .await
        .expect("card in time")
        .expect("card fetch");
    let mut card: AgentCard = response.json().await.expect("card JSON");
    card.capabilities.streaming = Some(streaming);
    card
}

/// A test card pointing at `url`.
fn card_at(url: &str, streaming: bool) -> AgentCard {
    let mut card = card("remote");
    card.supported_interfaces[0].url = url.to_string();
    card.capabilities.streaming = Some(streaming);
    card
}

fn remote(card: AgentCard, settings: UpstreamSettings) -> RemoteAgent {
    RemoteAgent::from_card(card, &loopback(), settings).expect("remote agent")
}

/// A gateway whose default agent `remote` proxies to `card`'s endpoint.
async fn gateway_for(card: AgentCard, settings: UpstreamSettings) -> TestBaton {
    baton()
        .agent("remote", remote(card, settings))
        .default_agent("remote")
        .start()
        .await
}

/// The upstream ids the gateway keeps with its task.
fn upstream_of(gateway: &TestBaton, task_id: &str) -> UpstreamRef {
    gateway
        .gateway
        .ledger()
        .get(task_id)
        .expect("ledger read")
        .expect("task in the ledger")
        .upstream
        .expect("upstream ids recorded")
}

fn text_of(value: &Value) -> &str {
    value["parts"][0]["text"].as_str().unwrap_or_default()
}

/// The first text of each message in a task's history.
fn history_texts(task: &Value) -> Vec<&str> {
    task["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(text_of)
        .collect()
}

/// Sends `text` to the gateway task `task_id` with a blocking SendMessage.
async fn send_more(gateway: &TestBaton, task_id: &str, text: &str) -> Reply {
    let more = user_message_on(task_id, &message_id("more"), text);
    gateway.call("SendMessage", json!({"message": more})).await
}

#[tokio::test]
async fn blocking_send_is_forwarded_under_gateway_ids() {
    let upstream = baton().start().await;
    for streaming in [true, false] {
        let gateway = gateway_for(
            published_card(&upstream, "scenario", streaming).await,
            fast_upstream(),
        )
        .await;
        let first_id = message_id("tck-complete-task");
        let result = gateway.send_text(&first_id, "hello", json!({})).await;
        let task = &result["task"];
        assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{result}");
        assert_eq!(text_of(&task["status"]["message"]), "Hello from TCK");
        let task_id = task["id"].as_str().unwrap();
        let context_id = task["contextId"].as_str().unwrap();
        assert_eq!(
            task["status"]["message"]["taskId"], task_id,
            "the status message carries the gateway's ids"
        );

        let up = upstream_of(&gateway, task_id);
        assert_ne!(up.task_id, task_id, "the gateway owns its task ids");
        assert_eq!(
            up.context_id, context_id,
            "a new task is sent in the gateway's context"
        );
        let upstream_task = upstream
            .call_at("/agents/scenario/a2a", "GetTask", json!({"id": up.task_id}))
            .await;
        let upstream_task = upstream_task.result();
        assert_eq!(upstream_task["status"]["state"], "TASK_STATE_COMPLETED");
        assert_eq!(upstream_task["history"][0]["messageId"], first_id.as_str());

        let got = gateway.call("GetTask", json!({"id": task_id})).await;
        assert_eq!(got.result()["status"]["state"], "TASK_STATE_COMPLETED");
        assert_eq!(got.result()["history"][0]["messageId"], first_id.as_str());

        // Artifacts come through too, once each.
        let result = gateway
            .send_text(&message_id("tck-artifact-text"), "x", json!({}))
            .await;
        let artifacts = result["task"]["artifacts"].as_array().unwrap();
        assert_eq!(artifacts.len(), 1, "{result}");
        assert_eq!(text_of(&artifacts[0]), "Generated text content");
        gateway.stop().await;
    }
    upstream.stop().await;
}

#[tokio::test]
async fn streaming_send_is_relayed_with_gateway_ids() {
    let upstream = baton().start().await;
    let gateway = gateway_for(
        published_card(&upstream, "scenario", true).await,
        fast_upstream(),
    )
    .await;
    let params = json!({"message": user_message(&message_id("tck-stream-001"), "go")});
    let reply = gateway
        .stream_at("/a2a", "SendStreamingMessage", params, 100)
        .await;
    assert!(reply.closed, "the stream ends after the terminal event");
    let results: Vec<&Value> = reply.events.iter().map(|e| &e["result"]).collect();
    let kinds: Vec<&str> = results
        .iter()
        .map(|r| r.as_object().unwrap().keys().next().unwrap().as_str())
        .collect();
    assert_eq!(
        kinds,
        ["task", "statusUpdate", "artifactUpdate", "statusUpdate"]
    );
    let task_id = results[0]["task"]["id"].as_str().unwrap();
    assert!(results[1..].iter().all(|r| {
        let event = r.as_object().unwrap().values().next().unwrap();
        event["taskId"] == task_id
    }));
    assert_eq!(
        text_of(&results[2]["artifactUpdate"]["artifact"]),
        "Stream hello from TCK"
    );
    assert_ne!(upstream_of(&gateway, task_id).task_id, task_id);
    gateway.stop().await;
    upstream.stop().await;
}

#[tokio::test]
async fn return_immediately_and_three_subscribers() {
    let gated = GatedAgent::new();
    let upstream = baton().agent("gated", gated.clone()).start().await;
    for streaming in [true, false] {
        let gateway = gateway_for(
            published_card(&upstream, "gated", streaming).await,
            fast_upstream(),
        )
        .await;
        let params = json!({
            "message": user_message(&message_id("m"), "fan out"),
            "configuration": {"returnImmediately": true},
        });
        let task = gateway.call("SendMessage", params).await.result()["task"].clone();
        let state = task["status"]["state"].as_str().unwrap();
        assert!(
            state == "TASK_STATE_SUBMITTED" || state == "TASK_STATE_WORKING",
            "{state}"
        );
        let task_id = task["id"].as_str().unwrap().to_string();
        // The upstream has taken the work before the gateway answered.
        let up = upstream_of(&gateway, &task_id);
        let at_upstream = upstream
            .call_at("/agents/gated/a2a", "GetTask", json!({"id": up.task_id}))
            .await;
        assert_eq!(
            at_upstream.result()["status"]["state"],
            "TASK_STATE_WORKING"
        );

        let mut subscribers = Vec::new();
        for _ in 0..3 {
            let response = gateway
                .open_stream("/a2a", "SubscribeToTask", json!({"id": task_id}))
                .await;
            subscribers.push(tokio::spawn(read_sse(response, 100)));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        gated.release(1);

        let mut streams = Vec::new();
        for subscriber in subscribers {
            let reply = subscriber.await.unwrap();
            assert!(reply.closed);
            let results: Vec<String> = reply
                .events
                .iter()
                .map(|e| e["result"].to_string())
                .collect();
            streams.push(results);
        }
        assert_eq!(streams[0], streams[1]);
        assert_eq!(streams[1], streams[2]);
        let last: Value = serde_json::from_str(streams[0].last().unwrap()).unwrap();
        assert_eq!(
            last["statusUpdate"]["status"]["state"], "TASK_STATE_COMPLETED",
            "streaming={streaming}"
        );
        assert!(
            streams[0]
                .iter()
                .any(|e| e.contains("artifactUpdate") && e.contains("done: fan out")),
            "{:?}",
            streams[0]
        );
        let done = gateway
            .wait_for_state("/a2a", &task_id, "TASK_STATE_COMPLETED")
            .await;
        assert_eq!(done["artifacts"].as_array().unwrap().len(), 1);
        gateway.stop().await;
    }
    upstream.stop().await;
}

#[tokio::test]
async fn direct_message_replies_pass_through() {
    let upstream = baton().start().await;
    for streaming in [true, false] {
        let gateway = gateway_for(
            published_card(&upstream, "scenario", streaming).await,
            fast_upstream(),
        )
        .await;
        let result = gateway
            .send_text(&message_id("tck-message-response"), "hi", json!({}))
            .await;
        assert_eq!(
            text_of(&result["message"]),
            "Direct message response",
            "{result}"
        );
        assert!(result.get("task").is_none());

        let params = json!({"message": user_message(&message_id("tck-message-response"), "hi")});
        let reply = gateway
            .stream_at("/a2a", "SendStreamingMessage", params, 100)
            .await;
        assert!(reply.closed);
        assert_eq!(reply.events.len(), 1);
        assert_eq!(
            text_of(&reply.events[0]["result"]["message"]),
            "Direct message response"
        );
        let listed = gateway.call("ListTasks", json!({})).await;
        assert_eq!(listed.result()["totalSize"], 0, "no task exists");
        gateway.stop().await;
    }
    upstream.stop().await;
}

#[tokio::test]
async fn input_required_resumes_the_upstream_task() {
    let upstream = baton().start().await;
    for streaming in [true, false] {
        let gateway = gateway_for(
            published_card(&upstream, "scenario", streaming).await,
            fast_upstream(),
        )
        .await;
        let first = gateway
            .send_text(&message_id("tck-input-required"), "book a table", json!({}))
            .await;
        let task = &first["task"];
        assert_eq!(task["status"]["state"], "TASK_STATE_INPUT_REQUIRED");
        assert_eq!(
            text_of(&task["status"]["message"]),
            "Please provide more input."
        );
        let task_id = task["id"].as_str().unwrap().to_string();
        let up = upstream_of(&gateway, &task_id);

        let answer_id = message_id("tck-complete-task");
        let answer = user_message_on(&task_id, &answer_id, "for two");
        let second = gateway
            .call("SendMessage", json!({"message": answer}))
            .await;
        assert_eq!(second.result()["task"]["id"], task_id.as_str());
        // Read back rather than trusting the blocking reply's state: the
        // gateway's wait can end on a late publication of the earlier
        // INPUT_REQUIRED event (a race in `wait_settled`, not in the proxy).
        let task = &gateway
            .wait_for_state("/a2a", &task_id, "TASK_STATE_COMPLETED")
            .await;
        let texts = history_texts(task);
        assert_eq!(
            texts,
            [
                "book a table",
                "Please provide more input.",
                "for two",
                "Hello from TCK"
            ]
        );
        assert_eq!(
            upstream_of(&gateway, &task_id),
            up,
            "still the same upstream task"
        );

        // The answer reached the upstream's own task, under its own ids.
        let at_upstream = upstream
            .call_at("/agents/scenario/a2a", "GetTask", json!({"id": up.task_id}))
            .await;
        let at_upstream = at_upstream.result();
        assert_eq!(at_upstream["status"]["state"], "TASK_STATE_COMPLETED");
        let answered = at_upstream["history"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["messageId"] == answer_id.as_str())
            .expect("the answer is in the upstream task's history");
        assert_eq!(answered["taskId"], up.task_id.as_str());
        assert_eq!(answered["contextId"], up.context_id.as_str());
        gateway.stop().await;
    }
    upstream.stop().await;
}

#[tokio::test]
async fn cancel_is_forwarded_to_the_upstream_task() {
    let gated = GatedAgent::new();
    let upstream = baton().agent("gated", gated.clone()).start().await;
    for streaming in [true, false] {
        let card = published_card(&upstream, "gated", streaming).await;
        let gateway = gateway_for(card.clone(), fast_upstream()).await;
        let params = json!({
            "message": user_message(&message_id("m"), "long job"),
            "configuration": {"returnImmediately": true},
        });
        let task_id = gateway.call("SendMessage", params).await.result()["task"]["id"]
            .as_str()
            .unwrap()
            .to_string();
        let up = upstream_of(&gateway, &task_id);
        let canceled = gateway.call("CancelTask", json!({"id": task_id})).await;
        assert_eq!(canceled.result()["status"]["state"], "TASK_STATE_CANCELED");
        let at_upstream = upstream
            .call_at("/agents/gated/a2a", "GetTask", json!({"id": up.task_id}))
            .await;
        assert_eq!(
            at_upstream.result()["status"]["state"],
            "TASK_STATE_CANCELED"
        );

        // A second cancel of the upstream task is the upstream's to refuse.
        let agent = remote(card, fast_upstream());
        let task = Task {
            id: task_id.clone(),
            ..Task::default()
        };
        let refused = agent.cancel(&task, Some(&up)).await.unwrap_err();
        assert!(
            matches!(refused, AgentError::Refused { code: -32002, .. }),
            "{refused:?}"
        );
        gateway.stop().await;
    }
    upstream.stop().await;
}

#[tokio::test]
async fn the_ledger_answers_when_the_upstream_is_gone() {
    let upstream = baton().start().await;
    let gateway = gateway_for(
        published_card(&upstream, "scenario", true).await,
        fast_upstream(),
    )
    .await;
    let result = gateway
        .send_text(&message_id("tck-artifact-text"), "x", json!({}))
        .await;
    let task_id = result["task"]["id"].as_str().unwrap().to_string();
    upstream.stop().await;

    let got = gateway.call("GetTask", json!({"id": task_id})).await;
    assert_eq!(got.result()["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(
        text_of(&got.result()["artifacts"][0]),
        "Generated text content"
    );
    let listed = gateway.call("ListTasks", json!({})).await;
    assert_eq!(listed.result()["tasks"][0]["id"], task_id.as_str());

    // A new message has nowhere to go, and says so.
    let reply = gateway
        .call(
            "SendMessage",
            json!({"message": user_message(&message_id("m"), "anyone?")}),
        )
        .await;
    assert_upstream_fault(&reply, "UPSTREAM_UNREACHABLE");
    gateway.stop().await;
}

/// Asserts a -32603 upstream fault with Baton's ErrorInfo `reason`, naming
/// the agent (every gateway here calls its one agent `remote`).
fn assert_upstream_fault(reply: &Reply, reason: &str) {
    assert_eq!(reply.code(), Some(-32603), "{}", reply.body);
    let info = &reply.body["error"]["data"][0];
    assert_eq!(info["reason"], reason, "{}", reply.body);
    assert_eq!(info["domain"], "baton.gateway");
    assert_eq!(
        info["metadata"],
        json!({"agentId": "remote"}),
        "{}",
        reply.body
    );
}

/// Asserts -32006 INVALID_AGENT_RESPONSE naming the agent `remote`.
fn assert_invalid_agent_response(reply: &Reply) {
    assert_eq!(reply.code(), Some(-32006), "{}", reply.body);
    let info = &reply.body["error"]["data"][0];
    assert_eq!(info["reason"], "INVALID_AGENT_RESPONSE", "{}", reply.body);
    assert_eq!(
        info["metadata"],
        json!({"agentId": "remote"}),
        "{}",
        reply.body
    );
}

async fn send_to_gateway(gateway: &TestBaton) -> Reply {
    gateway
        .call(
            "SendMessage",
            json!({"message": user_message(&message_id("m"), "hello")}),
        )
        .await
}

/// An agent that forgets the task it took (-32001 to the polls): the
/// gateway task fails with the agent's error, its reason `UPSTREAM_ERROR`
/// naming the agent and the code.
#[tokio::test]
async fn a_task_its_agent_forgets_fails_with_the_agents_error_code() {
    let (url, _, server) = fake_agent(|request| {
        let id = request["id"].clone();
        let answer = if request["method"] == "SendMessage" {
            json!({"jsonrpc": "2.0", "id": id, "result": {"task": {
                "id": "up-task", "contextId": "up-context",
                "status": {"state": "TASK_STATE_WORKING"}}}})
        } else {
            json!({"jsonrpc": "2.0", "id": id,
                   "error": {"code": -32001, "message": "no task up-task here"}})
        };
        ("application/json", answer.to_string())
    })
    .await;
    let gateway = gateway_for(card_at(&url, false), fast_upstream()).await;
    let reply = send_to_gateway(&gateway).await;
    let task = &reply.result()["task"];
    assert_eq!(
        task["status"]["state"], "TASK_STATE_FAILED",
        "{}",
        reply.body
    );
    assert_eq!(reason(task), "UPSTREAM_ERROR");
    let message = &task["status"]["message"];
    let status = message["parts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|part| !part["data"].is_null())
        .unwrap();
    assert_eq!(
        status["data"]["detail"],
        json!({"agent": "remote", "code": -32001})
    );
    let text = message["parts"][0]["text"].as_str().unwrap();
    assert!(text.contains("no task up-task here"), "{text}");
    gateway.stop().await;
    server.abort();
}

#[tokio::test]
async fn an_unreachable_upstream_is_reported_as_such() {
    // A port nobody listens on.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/a2a", listener.local_addr().unwrap());
    drop(listener);
    for streaming in [true, false] {
        let gateway = gateway_for(card_at(&url, streaming), fast_upstream()).await;
        assert_upstream_fault(&send_to_gateway(&gateway).await, "UPSTREAM_UNREACHABLE");
        // A stream refused before its first event is a plain JSON-RPC error.
        let message = user_message(&message_id("m"), "hello");
        let streamed = gateway
            .call("SendStreamingMessage", json!({"message": message}))
            .await;
        assert_upstream_fault(&streamed, "UPSTREAM_UNREACHABLE");
        let listed = gateway.call("ListTasks", json!({})).await;
        assert_eq!(listed.result()["totalSize"], 0, "no task was created");
        gateway.stop().await;
    }
}

/// An agent's URL whose server accepts connections and never answers, and
/// the task holding them (abort it at the end).
async fn silent_agent() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/a2a", listener.local_addr().unwrap());
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    (url, holder)
}

#[tokio::test]
async fn a_silent_upstream_times_out() {
    let (url, holder) = silent_agent().await;
    let settings = UpstreamSettings {
        request_timeout: Duration::from_millis(300),
        ..fast_upstream()
    };
    for streaming in [true, false] {
        let gateway = gateway_for(card_at(&url, streaming), settings.clone()).await;
        let started = std::time::Instant::now();
        assert_upstream_fault(&send_to_gateway(&gateway).await, "UPSTREAM_TIMEOUT");
        assert!(started.elapsed() < Duration::from_secs(5));
        gateway.stop().await;
    }
    holder.abort();
}

#[tokio::test]
async fn a_deadline_that_passes_before_a_plain_call_is_answered_is_an_upstream_timeout() {
    // Silent well within the call's own timeout (3 s).
    let (url, holder) = silent_agent().await;
    let gateway = gateway_for(card_at(&url, false), fast_upstream()).await;
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(300);
    let mut message = user_message(&message_id("m"), "hello");
    message["metadata"] = json!({"urn:baton:handoff:v1": {"deadline": deadline.to_rfc3339()}});
    let started = std::time::Instant::now();
    let reply = gateway
        .call("SendMessage", json!({"message": message}))
        .await;
    assert_upstream_fault(&reply, "UPSTREAM_TIMEOUT");
    // The deadline's doing, not the 3 s request timeout's.
    assert!(started.elapsed() < Duration::from_secs(2));
    let listed = gateway.call("ListTasks", json!({})).await;
    assert_eq!(listed.result()["totalSize"], 0, "no task was created");
    gateway.stop().await;
    holder.abort();
}

/// What a fake agent saw of the last request.
#[derive(Default)]
struct Seen {
    headers: Option<HeaderMap>,
    body: Option<Value>,
}

/// A fake agent answering every POST with `answer(request)`:
/// (content type, body).
async fn fake_agent(
    answer: fn(&Value) -> (&'static str, String),
) -> (String, Arc<Mutex<Seen>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let recorder = seen.clone();
    let app = axum::Router::new().fallback(move |headers: HeaderMap, body: axum::body::Bytes| {
        let recorder = recorder.clone();
        async move {
            let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let (content_type, text) = answer(&request);
            let mut seen = recorder.lock().unwrap();
            seen.headers = Some(headers);
            seen.body = Some(request);
            (StatusCode::OK, [(header::CONTENT_TYPE, content_type)], text)
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/a2a", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, seen, server)
}

/// What a fake agent holding one task answers: `SubscribeToTask` is refused
/// as for a settled task (-32004), anything else gets the task COMPLETED
/// with one artifact.
fn settled_task_answer(request: &Value) -> (&'static str, String) {
    let id = request["id"].clone();
    let answer = if request["method"] == "SubscribeToTask" {
        json!({"jsonrpc": "2.0", "id": id,
               "error": {"code": -32004, "message": "the task is terminal"}})
    } else {
        json!({"jsonrpc": "2.0", "id": id, "result": {
            "id": "up-task", "contextId": "up-context",
            "status": {"state": "TASK_STATE_COMPLETED"},
            "artifacts": [{"artifactId": "a1", "parts": [{"text": "done upstream"}]}],
        }})
    };
    ("application/json", answer.to_string())
}

#[tokio::test]
async fn a_non_json_answer_is_an_invalid_agent_response() {
    let (url, _, server) = fake_agent(|_| ("text/html", "<html>Bad gateway</html>".into())).await;
    expect_invalid_answer(&url, &[true, false], fast_upstream(), "not JSON").await;
    server.abort();
}

/// Sends through a gateway for the agent at `url`, with a card declaring
/// each of `streaming`: the answer is an invalid agent response whose
/// message `says` what is wrong.
async fn expect_invalid_answer(
    url: &str,
    streaming: &[bool],
    settings: UpstreamSettings,
    says: &str,
) {
    for &streaming in streaming {
        let gateway = gateway_for(card_at(url, streaming), settings.clone()).await;
        let reply = send_to_gateway(&gateway).await;
        assert_invalid_agent_response(&reply);
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{}", reply.body);
        gateway.stop().await;
    }
}

#[tokio::test]
async fn an_answer_over_the_size_limit_is_an_invalid_agent_response() {
    let (url, _, server) =
        fake_agent(|request| ("application/json", big_answer(request).to_string())).await;
    expect_invalid_answer(&url, &[true, false], limited(), "larger than 1024 bytes").await;
    server.abort();
}

/// Answers larger than 1 KB are refused.
fn limited() -> UpstreamSettings {
    UpstreamSettings {
        max_body_bytes: 1024,
        ..fast_upstream()
    }
}

/// A JSON-RPC answer to `request` whose message text is 4 KB.
fn big_answer(request: &Value) -> Value {
    json!({"jsonrpc": "2.0", "id": request["id"], "result": {"message": {
        "messageId": "big", "role": "ROLE_AGENT", "parts": [{"text": "x".repeat(4096)}]}}})
}

#[tokio::test]
async fn a_stream_event_over_the_size_limit_is_an_invalid_agent_response() {
    // The whole event arrives in one piece, with nothing left pending.
    let (url, _, server) = fake_agent(|request| {
        (
            "text/event-stream",
            format!("data: {}\n\n", big_answer(request)),
        )
    })
    .await;
    let says = "a stream event is larger than 1024 bytes";
    expect_invalid_answer(&url, &[true], limited(), says).await;
    server.abort();
}

#[tokio::test]
async fn a_chunked_answer_over_the_size_limit_is_an_invalid_agent_response() {
    // No Content-Length: the limit holds while the chunks are read.
    let app = axum::Router::new().fallback(|body: axum::body::Bytes| async move {
        let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let text = big_answer(&request).to_string().into_bytes();
        let chunks: Vec<Result<axum::body::Bytes, std::io::Error>> = text
            .chunks(512)
            .map(|chunk| Ok(axum::body::Bytes::copy_from_slice(chunk)))
            .collect();
        (
            [(header::CONTENT_TYPE, "application/json")],
            axum::body::Body::from_stream(futures::stream::iter(chunks)),
        )
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/a2a", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let says = "the answer is larger than 1024 bytes";
    expect_invalid_answer(&url, &[false], limited(), says).await;
    server.abort();
}

/// A JSON-RPC answer whose result is no A2A object.
fn not_a2a(request: &Value) -> (&'static str, String) {
    let id = &request["id"];
    let body = json!({"jsonrpc": "2.0", "id": id, "result": {"bogus": true}});
    ("application/json", body.to_string())
}

#[tokio::test]
async fn an_answer_that_is_not_a2a_is_an_invalid_agent_response() {
    let (url, seen, server) = fake_agent(not_a2a).await;
    for streaming in [true, false] {
        let gateway = gateway_for(card_at(&url, streaming), fast_upstream()).await;
        assert_invalid_agent_response(&send_to_gateway(&gateway).await);

        // What the agent received: an A2A 1.0 request.
        let (headers, body) = {
            let seen = seen.lock().unwrap();
            (seen.headers.clone().unwrap(), seen.body.clone().unwrap())
        };
        assert_eq!(headers["a2a-version"], "1.0");
        assert_eq!(headers["content-type"], "application/json");
        let method = if streaming {
            "SendStreamingMessage"
        } else {
            "SendMessage"
        };
        assert_eq!(body["method"], method);
        assert_eq!(body["params"]["message"]["parts"][0]["text"], "hello");
        assert!(body["params"]["message"].get("taskId").is_none());
        assert!(body["params"]["message"]["contextId"].is_string());
        assert_eq!(
            body["params"]["configuration"]["returnImmediately"].as_bool() == Some(true),
            !streaming
        );
        gateway.stop().await;
    }
    server.abort();
}

#[tokio::test]
async fn credentials_in_the_agent_url_are_sent_as_basic_authorization() {
    let (url, seen, server) = fake_agent(not_a2a).await;
    let with_credentials = url.replacen("http://", "http://svc:S3cret@", 1);
    for streaming in [true, false] {
        // Each run reads only what its own send delivered.
        *seen.lock().unwrap() = Seen::default();
        let gateway = gateway_for(card_at(&with_credentials, streaming), fast_upstream()).await;
        send_to_gateway(&gateway).await;
        let headers = seen
            .lock()
            .unwrap()
            .headers
            .clone()
            .expect("the agent was called");
        // base64("svc:S3cret")
        assert_eq!(headers["authorization"], "Basic c3ZjOlMzY3JldA==");
        gateway.stop().await;
    }
    server.abort();
}

/// A JSON-RPC error an agent might send, detail and all.
fn agent_error() -> Value {
    json!({
        "code": -32005,
        "message": "Content type image/gif is not supported",
        "data": [{
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": "CONTENT_TYPE_NOT_SUPPORTED",
            "domain": "a2a-protocol.org",
            "metadata": {"mediaType": "image/gif"},
        }],
    })
}

#[tokio::test]
async fn an_upstream_error_passes_through_unchanged() {
    let (url, _, server) = fake_agent(|request| {
        let id = &request["id"];
        let body = json!({"jsonrpc": "2.0", "id": id, "error": agent_error()});
        ("application/json", body.to_string())
    })
    .await;
    for streaming in [true, false] {
        let gateway = gateway_for(card_at(&url, streaming), fast_upstream()).await;
        let reply = send_to_gateway(&gateway).await;
        assert_eq!(reply.body["error"], agent_error(), "streaming={streaming}");
        gateway.stop().await;
    }
    server.abort();

    // An error event inside a stream, too.
    let (url, _, server) = fake_agent(|request| {
        let id = &request["id"];
        let body = json!({"jsonrpc": "2.0", "id": id, "error": agent_error()});
        (
            "text/event-stream",
            format!("event: error\ndata: {body}\n\n"),
        )
    })
    .await;
    let gateway = gateway_for(card_at(&url, true), fast_upstream()).await;
    let reply = send_to_gateway(&gateway).await;
    assert_eq!(reply.body["error"], agent_error());
    gateway.stop().await;
    server.abort();
}

#[tokio::test]
async fn a_stream_that_ends_early_is_followed_by_polling() {
    // The stream shows the task WORKING, then closes; GetTask has the rest.
    let (url, seen, server) = fake_agent(|request| {
        let id = &request["id"];
        let task = |state: &str| {
            json!({
                "id": "up-7",
                "contextId": "up-ctx",
                "status": {"state": state},
                "artifacts": if state == "TASK_STATE_COMPLETED" {
                    json!([{"artifactId": "a1", "parts": [{"text": "late result"}]}])
                } else {
                    json!([])
                },
            })
        };
        if request["method"] == "SendStreamingMessage" {
            let event =
                json!({"jsonrpc": "2.0", "id": id, "result": {"task": task("TASK_STATE_WORKING")}});
            ("text/event-stream", format!(": hello\n\ndata: {event}\n\n"))
        } else {
            let body = json!({"jsonrpc": "2.0", "id": id, "result": task("TASK_STATE_COMPLETED")});
            ("application/json", body.to_string())
        }
    })
    .await;
    let gateway = gateway_for(card_at(&url, true), fast_upstream()).await;
    let result = gateway
        .send_text(&message_id("m"), "hello", json!({}))
        .await;
    let task = &result["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{result}");
    assert_eq!(text_of(&task["artifacts"][0]), "late result");
    let task_id = task["id"].as_str().unwrap();
    assert_eq!(
        upstream_of(&gateway, task_id),
        UpstreamRef {
            task_id: "up-7".into(),
            context_id: "up-ctx".into()
        }
    );
    let last = seen.lock().unwrap().body.clone().unwrap();
    assert_eq!(last["method"], "GetTask");
    assert_eq!(
        last["params"]["id"], "up-7",
        "polled with the upstream's id"
    );
    gateway.stop().await;
    server.abort();
}

/// Runs `recover` to its end, returning its outcome and what it reported.
async fn recover(
    agent: &RemoteAgent,
    task: &Task,
    upstream: Option<&UpstreamRef>,
) -> (Result<(), AgentError>, Vec<AgentEvent>) {
    let (events, mut receiver) = AgentEvents::channel(64);
    let collect = async {
        let mut seen = Vec::new();
        while let Some(event) = receiver.recv().await {
            seen.push(event);
        }
        seen
    };
    let run = async {
        // Dropping the sink ends the collection.
        agent
            .recover(task, upstream, events, Default::default())
            .await
    };
    tokio::time::timeout(WAIT, async { tokio::join!(run, collect) })
        .await
        .expect("recovery ends in time")
}

#[tokio::test]
async fn recover_follows_a_running_upstream_task_to_its_end() {
    let upstream = baton().start().await;
    // Long-running: WORKING now, COMPLETED a few seconds later.
    let started = upstream
        .call_at(
            "/agents/scenario/a2a",
            "SendMessage",
            json!({
                "message": user_message(&message_id("test-resubscribe-message-id"), "slow"),
                "configuration": {"returnImmediately": true},
            }),
        )
        .await;
    let started = started.result()["task"].clone();
    let up = UpstreamRef {
        task_id: started["id"].as_str().unwrap().into(),
        context_id: started["contextId"].as_str().unwrap().into(),
    };
    // The gateway's task as a restart found it.
    let task = Task {
        id: "gateway-task".into(),
        context_id: "gateway-context".into(),
        status: TaskStatus::now(TaskState::Working, None),
        ..Task::default()
    };
    let streaming = remote(
        published_card(&upstream, "scenario", true).await,
        fast_upstream(),
    );
    let polling = remote(
        published_card(&upstream, "scenario", false).await,
        fast_upstream(),
    );
    let ((streamed, streamed_events), (polled, polled_events)) = tokio::join!(
        recover(&streaming, &task, Some(&up)),
        recover(&polling, &task, Some(&up)),
    );
    for (outcome, events) in [(streamed, streamed_events), (polled, polled_events)] {
        outcome.expect("recovered");
        let states: Vec<TaskState> = events
            .iter()
            .filter_map(|e| match e {
                AgentEvent::Status { state, .. } => Some(*state),
                _ => None,
            })
            .collect();
        assert_eq!(
            states,
            [TaskState::Completed],
            "only the change is reported: {events:?}"
        );
        assert!(
            !events.iter().any(|e| matches!(e, AgentEvent::Bound(_))),
            "the ids are already known: {events:?}"
        );
    }

    // A task the upstream never had (or forgot) fails with its answer.
    let forgotten = UpstreamRef {
        task_id: "no-such-task".into(),
        context_id: String::new(),
    };
    let (outcome, events) = recover(&polling, &task, Some(&forgotten)).await;
    assert!(
        matches!(outcome, Err(AgentError::Refused { code: -32001, .. })),
        "{outcome:?}"
    );
    assert!(events.is_empty());
    // Without upstream ids there is nothing to pick up.
    let (outcome, _) = recover(&polling, &task, None).await;
    assert!(matches!(outcome, Err(AgentError::Failed(_))), "{outcome:?}");
    upstream.stop().await;
}

#[tokio::test]
async fn recover_waits_for_an_agent_that_is_not_up_yet() {
    // A port nobody listens on yet: every call is refused until the agent
    // comes up on it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/a2a");
    let up = UpstreamRef {
        task_id: "up-task".into(),
        context_id: "up-context".into(),
    };
    let task = Task {
        id: "gateway-task".into(),
        context_id: "gateway-context".into(),
        status: TaskStatus::now(TaskState::Working, None),
        ..Task::default()
    };
    let patient = UpstreamSettings {
        follow_outage: Duration::from_secs(30),
        ..fast_upstream()
    };
    let streaming = remote(card_at(&url, true), patient.clone());
    let polling = remote(card_at(&url, false), patient);
    let agent_comes_up = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(800)).await;
        let app = axum::Router::new().fallback(|body: axum::body::Bytes| async move {
            let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let (content_type, text) = settled_task_answer(&request);
            ([(header::CONTENT_TYPE, content_type)], text)
        });
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("the agent's port is free again");
        let _ = axum::serve(listener, app).await;
    });
    let ((streamed, streamed_events), (polled, polled_events)) = tokio::join!(
        recover(&streaming, &task, Some(&up)),
        recover(&polling, &task, Some(&up)),
    );
    for (outcome, events) in [(streamed, streamed_events), (polled, polled_events)] {
        outcome.expect("recovered once the agent was up");
        assert!(
            matches!(
                events.as_slice(),
                [
                    AgentEvent::Artifact { .. },
                    AgentEvent::Status {
                        state: TaskState::Completed,
                        ..
                    }
                ]
            ),
            "{events:?}"
        );
    }
    agent_comes_up.abort();

    // An agent that never comes back fails the task once the outage
    // outlasts the tolerance, with the connection error.
    let impatient = UpstreamSettings {
        follow_outage: Duration::from_millis(300),
        ..fast_upstream()
    };
    let polling = remote(card_at(&url, false), impatient);
    let (outcome, events) = recover(&polling, &task, Some(&up)).await;
    assert!(
        matches!(outcome, Err(AgentError::Unreachable(_))),
        "{outcome:?}"
    );
    assert!(events.is_empty(), "{events:?}");
}

#[tokio::test]
async fn a_remote_agent_reporting_past_the_event_limit_is_sent_cancel_task() {
    let chatty = ChattyAgent::new("chatty");
    let limit = |settings: &mut GatewaySettings| settings.max_task_events = 20;
    remote_agent_past_a_limit_is_sent_cancel_task(chatty, limit, "EVENT_LIMIT_EXCEEDED").await;
}

#[tokio::test]
async fn a_remote_agent_reporting_past_the_size_limit_is_sent_cancel_task() {
    let chatty = ChattyAgent::with_note_bytes("chatty", 100 * 1024);
    let limit = |settings: &mut GatewaySettings| settings.max_task_bytes = 1024 * 1024;
    remote_agent_past_a_limit_is_sent_cancel_task(chatty, limit, "TASK_SIZE_EXCEEDED").await;
}

/// `chatty`, behind a second Baton, reports until the gateway's `limit`
/// fails the task with `expected`; its own task is canceled there.
async fn remote_agent_past_a_limit_is_sent_cancel_task(
    chatty: ChattyAgent,
    limit: fn(&mut GatewaySettings),
    expected: &str,
) {
    let upstream = baton().agent("chatty", chatty.clone()).start().await;
    let card = published_card(&upstream, "chatty", true).await;
    let gateway = baton()
        .agent("remote", remote(card, fast_upstream()))
        .default_agent("remote")
        .tune(limit)
        .start()
        .await;
    let result = gateway
        .send_text(&message_id("talk"), "talk", json!({}))
        .await;
    let task = &result["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{result}");
    assert_eq!(reason(task), expected);
    // The agent's own task was canceled there, so it stopped reporting.
    // The FAILED may come before the cancel is through (it waits 200 ms).
    let up = upstream_of(&gateway, task["id"].as_str().unwrap());
    let canceled = async {
        loop {
            let upstream_task = upstream
                .call_at("/agents/chatty/a2a", "GetTask", json!({"id": up.task_id}))
                .await;
            if upstream_task.result()["status"]["state"] == "TASK_STATE_CANCELED" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(WAIT, canceled)
        .await
        .expect("the agent's task is canceled");
    let stopped_at = chatty.reported();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(chatty.reported(), stopped_at);
    gateway.stop().await;
    upstream.stop().await;
}

/// A fake agent's JSON-RPC answer to request `id`: `member` is `result` or
/// `error`.
fn rpc_answer(id: &Value, member: &str, value: Value) -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut body = json!({"jsonrpc": "2.0", "id": id});
    body[member] = value;
    let json = [(header::CONTENT_TYPE, "application/json")];
    (json, body.to_string()).into_response()
}

/// One SSE frame of a fake agent's stream answering request `id`.
fn sse_frame(id: &Value, event: Value) -> Result<String, std::convert::Infallible> {
    let event = json!({"jsonrpc": "2.0", "id": id, "result": event});
    Ok(format!("data: {event}\n\n"))
}

/// A message added to a task comes before the agent's answer to it in the
/// task's history: the gateway wrote the message once the agent took it,
/// and the answer, reported meanwhile, could be written first. On two
/// workers, a hundred times, each task left polled: the race needs the load
/// (without the fix it showed by round 60 in each of five runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_comes_before_the_agents_answer_in_the_history() {
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| async move {
        let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let message = &request["params"]["message"];
        let mut task = json!({"id": "up-1", "contextId": "up-ctx",
                "status": {"state": "TASK_STATE_WORKING"}});
        let result = if request["method"] == "GetTask" {
            task
        } else if request["method"] == "CancelTask" {
            task["status"]["state"] = json!("TASK_STATE_CANCELED");
            task
        } else if message["taskId"] == "up-1" {
            let text = format!("noted: {}", text_of(message));
            json!({"message": {"messageId": message_id("noted"), "role": "ROLE_AGENT",
                    "taskId": "up-1", "contextId": "up-ctx", "parts": [{"text": text}]}})
        } else {
            json!({"task": task})
        };
        rpc_answer(&request["id"], "result", result)
    });
    let url = format!("{}/a2a", serve_on_loopback(app).await);
    let gateway = gateway_for(card_at(&url, false), fast_upstream()).await;
    for round in 0..100 {
        let params = json!({"configuration": {"returnImmediately": true}});
        let first = gateway.send_text(&message_id("m"), "start", params).await;
        let task_id = first["task"]["id"].as_str().unwrap().to_string();
        // Followed once WORKING: a message then is a follow-up.
        let record = || gateway.gateway.ledger().get(&task_id).unwrap().unwrap();
        let working = || record().task.status.state == TaskState::Working;
        wait_until("the task WORKING", working).await;
        let more = user_message_on(&task_id, &message_id("more"), "more");
        let params = json!({"message": more, "configuration": {"returnImmediately": true}});
        let reply = gateway.call("SendMessage", params).await;
        assert!(reply.body["result"].is_object(), "{:?}", reply.body);
        wait_until("the agent's answer", || record().task.history.len() >= 3).await;
        let task = gateway.call("GetTask", json!({"id": task_id})).await;
        let texts = history_texts(&task.body["result"]);
        assert_eq!(texts, ["start", "more", "noted: more"], "round {round}");
    }
    gateway.stop().await;
}

/// What the agent of [`chunking_agent`] makes of a message added to its task.
#[derive(Clone, Copy)]
enum OnFollowUp {
    /// Appends a second chunk, then completes.
    Chunk,
    /// Takes it as the answer to a question its streams tell only after
    /// (INPUT_REQUIRED, then they close), and completes with the second
    /// chunk, as GetTask shows.
    AnswersAStaleQuestion,
    /// Refuses it with an error; the task goes on.
    Refuses,
}

/// An agent holding one task, `up-1`, which it keeps WORKING with a first
/// artifact chunk until a message is added to it. Like a real agent it
/// sends each event to every stream open on the task, and GetTask shows
/// the task as it is. Returns its URL and the requests it saw.
async fn chunking_agent(on_follow_up: OnFollowUp) -> (String, Arc<Mutex<Vec<Value>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (events, _) = tokio::sync::broadcast::channel::<Value>(16);
    let held = Arc::new(Mutex::new(json!({"id": "up-1", "contextId": "up-ctx",
        "status": {"state": "TASK_STATE_WORKING"}, "artifacts": []})));
    let chunk = |text: &str, append: bool| {
        json!({"artifactUpdate": {"taskId": "up-1", "contextId": "up-ctx", "append": append,
            "artifact": {"artifactId": "a1", "parts": [{"text": text}]}}})
    };
    let status = |state: &str| {
        json!({"statusUpdate": {"taskId": "up-1", "contextId": "up-ctx",
            "status": {"state": state}}})
    };
    // Applies `event` to the task, then sends it to the open streams; a
    // `stream_only` event only goes to the streams.
    let publish = {
        let (held, events) = (held.clone(), events.clone());
        move |event: Value, stream_only: bool| {
            if !stream_only {
                let mut task = held.lock().unwrap();
                if let Some(state) = event["statusUpdate"]["status"]["state"].as_str() {
                    task["status"]["state"] = json!(state);
                }
                let update = &event["artifactUpdate"];
                if update.is_object() {
                    let parts = update["artifact"]["parts"].as_array().unwrap().clone();
                    match task["artifacts"].as_array_mut().unwrap().first_mut() {
                        Some(held) if update["append"] == true => {
                            held["parts"].as_array_mut().unwrap().extend(parts);
                        }
                        _ => task["artifacts"] = json!([update["artifact"]]),
                    }
                }
            }
            let _ = events.send(event);
        }
    };
    let recorder = seen.clone();
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
        use axum::response::IntoResponse;
        use futures::StreamExt;
        let (recorder, events, held, publish) = (
            recorder.clone(),
            events.clone(),
            held.clone(),
            publish.clone(),
        );
        async move {
            let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            recorder.lock().unwrap().push(request.clone());
            let (id, method) = (request["id"].clone(), request["method"].clone());
            let later = tokio_stream::wrappers::BroadcastStream::new(events.subscribe());
            let follow_up = request["params"]["message"]["taskId"] == "up-1";
            if method == "GetTask" {
            } else if !follow_up {
                publish(chunk("a", false), false);
            } else {
                match on_follow_up {
                    OnFollowUp::Refuses => {
                        let error = json!({"code": -32602, "message": "no more input, thanks"});
                        return rpc_answer(&id, "error", error);
                    }
                    OnFollowUp::Chunk => {
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            publish(chunk("b", true), false);
                            publish(status("TASK_STATE_COMPLETED"), false);
                        });
                    }
                    OnFollowUp::AnswersAStaleQuestion => {
                        publish(chunk("b", true), false);
                        let held = held.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            held.lock().unwrap()["status"]["state"] = json!("TASK_STATE_COMPLETED");
                            publish(status("TASK_STATE_INPUT_REQUIRED"), true);
                        });
                    }
                }
            }
            let snapshot = held.lock().unwrap().clone();
            if method != "SendStreamingMessage" {
                let result = if method == "GetTask" {
                    snapshot
                } else {
                    json!({"task": snapshot})
                };
                return rpc_answer(&id, "result", result);
            }
            // The snapshot, then what happens, until the task is settled.
            let stream = futures::stream::iter([json!({"task": snapshot})])
                .chain(later.filter_map(|event| std::future::ready(event.ok())))
                .scan(false, |settled, event| {
                    let last = *settled;
                    let state = event["statusUpdate"]["status"]["state"].as_str();
                    *settled = state.is_some_and(|s| s != "TASK_STATE_WORKING");
                    std::future::ready((!last).then_some(event))
                })
                .map(move |event| sse_frame(&id, event));
            let stream = axum::body::Body::from_stream(stream);
            ([(header::CONTENT_TYPE, "text/event-stream")], stream).into_response()
        }
    });
    let url = serve_on_loopback(app).await;
    (format!("{url}/a2a"), seen)
}

/// Starts a task at a [`chunking_agent`] through a gateway and waits until
/// the gateway holds its first chunk; returns the gateway task id.
async fn working_task_with_a_chunk(gateway: &TestBaton) -> String {
    let start = json!({"configuration": {"returnImmediately": true}});
    let first = gateway.send_text(&message_id("m"), "start", start).await;
    let task_id = first["task"]["id"].as_str().unwrap().to_string();
    let holds_first_chunk = || {
        let record = gateway.gateway.ledger().get(&task_id).ok().flatten();
        record.is_some_and(|r| r.task.artifacts.first().is_some_and(|a| a.parts.len() == 1))
    };
    wait_until("the first chunk", holds_first_chunk).await;
    task_id
}

fn part_texts(artifact: &Value) -> Vec<&str> {
    artifact["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(text_of_part)
        .collect()
}

fn text_of_part(part: &Value) -> &str {
    part["text"].as_str().unwrap_or_default()
}

#[tokio::test]
async fn a_message_added_to_a_working_task_goes_through_the_one_feed_of_it() {
    // (the agent streams, the added message's caller streams)
    for (streaming, streamed) in [(true, false), (false, false), (true, true)] {
        let (url, seen) = chunking_agent(OnFollowUp::Chunk).await;
        let gateway = gateway_for(card_at(&url, streaming), fast_upstream()).await;
        let task_id = working_task_with_a_chunk(&gateway).await;

        let more = json!({"message": user_message_on(&task_id, &message_id("more"), "more")});
        if streamed {
            let reply = gateway
                .stream_at("/a2a", "SendStreamingMessage", more, 10)
                .await;
            assert!(reply.closed, "{:?}", reply.events);
            let first = &reply.events[0]["result"]["task"];
            assert_eq!(first["status"]["state"], "TASK_STATE_WORKING");
            assert_eq!(first["history"][1]["parts"][0]["text"], "more");
            let last = &reply.events.last().unwrap()["result"]["statusUpdate"];
            assert_eq!(last["status"]["state"], "TASK_STATE_COMPLETED");
        } else {
            let reply = gateway.call("SendMessage", more).await;
            let task = &reply.result()["task"];
            assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
        }
        let task = gateway
            .wait_for_state("/a2a", &task_id, "TASK_STATE_COMPLETED")
            .await;
        assert_eq!(
            part_texts(&task["artifacts"][0]),
            ["a", "b"],
            "each chunk once"
        );
        let history = history_texts(&task);
        assert_eq!(history, ["start", "more"]);

        // One feed of the task; the added message went as a plain send.
        let seen = seen.lock().unwrap().clone();
        let sends: Vec<&Value> = seen.iter().filter(|r| r["method"] != "GetTask").collect();
        let methods: Vec<&str> = sends
            .iter()
            .map(|r| r["method"].as_str().unwrap())
            .collect();
        let opening = if streaming {
            "SendStreamingMessage"
        } else {
            "SendMessage"
        };
        assert_eq!(methods, [opening, "SendMessage"], "streaming: {streaming}");
        let added = &sends[1]["params"];
        assert_eq!(added["message"]["taskId"], "up-1");
        assert_eq!(added["message"]["contextId"], "up-ctx");
        assert_eq!(added["configuration"]["returnImmediately"], true);
        gateway.stop().await;
    }
}

#[tokio::test]
async fn an_interruption_streamed_after_a_follow_up_is_checked_with_the_agent() {
    let (url, _) = chunking_agent(OnFollowUp::AnswersAStaleQuestion).await;
    let gateway = gateway_for(card_at(&url, true), fast_upstream()).await;
    let task_id = working_task_with_a_chunk(&gateway).await;
    let more = user_message_on(&task_id, &message_id("more"), "more");
    let reply = gateway
        .call(
            "SendMessage",
            json!({"message": more, "configuration": {"returnImmediately": true}}),
        )
        .await;
    assert_eq!(reply.result()["task"]["id"], task_id.as_str());
    // The stream's INPUT_REQUIRED came after the agent took the message:
    // GetTask has the task completed.
    let task = gateway
        .wait_for_state("/a2a", &task_id, "TASK_STATE_COMPLETED")
        .await;
    assert_eq!(part_texts(&task["artifacts"][0]), ["a", "b"]);
    gateway.stop().await;
}

#[tokio::test]
async fn a_follow_up_the_agent_refuses_is_its_senders_error_and_the_task_goes_on() {
    let (url, seen) = chunking_agent(OnFollowUp::Refuses).await;
    let gateway = gateway_for(card_at(&url, true), fast_upstream()).await;
    let task_id = working_task_with_a_chunk(&gateway).await;
    let reply = send_more(&gateway, &task_id, "more").await;
    assert_eq!(reply.code(), Some(-32602), "{:?}", reply.body);
    let record = gateway.gateway.ledger().get(&task_id).unwrap().unwrap();
    assert_eq!(record.task.status.state, TaskState::Working);
    assert_eq!(
        record.task.history.len(),
        1,
        "the refused message is not the task's"
    );
    // No second feed of the task came either.
    let methods: Vec<Value> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|r| r["method"].clone())
        .collect();
    assert_eq!(methods, ["SendStreamingMessage", "SendMessage"]);
    gateway.stop().await;
}

/// What the agent of [`auth_agent`] does once its task is AUTH_REQUIRED.
#[derive(Clone, Copy, PartialEq)]
enum AtAuth {
    /// Gets the credential out of band 100 ms later and completes on the
    /// same stream (A2A §7.6.1).
    GoesOnOutOfBand,
    /// Ends its stream; a message to the task completes it.
    TakesAMessage,
    /// Ends its stream; a message to the task is not enough, and it asks
    /// again on the stream the message opens.
    AsksAgain,
    /// Ends its stream; a message to the task is refused with an error, the
    /// first event of the stream the message opens.
    RefusesInItsStream,
}

/// An agent that puts its one task, `up-1`, at AUTH_REQUIRED and then does
/// `at_auth`. Returns its URL and the methods it was called with.
async fn auth_agent(at_auth: AtAuth) -> (String, Arc<Mutex<Vec<String>>>) {
    let called = Arc::new(Mutex::new(Vec::new()));
    let held = Arc::new(Mutex::new(json!({"id": "up-1", "contextId": "up-ctx",
        "status": {"state": "TASK_STATE_AUTH_REQUIRED"}})));
    let recorder = called.clone();
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
        use axum::response::IntoResponse;
        let (recorder, held) = (recorder.clone(), held.clone());
        async move {
            let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let method = request["method"].as_str().unwrap_or_default().to_string();
            recorder.lock().unwrap().push(method.clone());
            let id = request["id"].clone();
            let complete = || {
                let mut task = held.lock().unwrap();
                task["status"]["state"] = json!("TASK_STATE_COMPLETED");
                task["artifacts"] = json!([{"artifactId": "a1", "parts": [{"text": "signed in"}]}]);
                task.clone()
            };
            let follow_up = request["params"]["message"]["taskId"] == "up-1";
            let mut events = Vec::new();
            match (method.as_str(), follow_up) {
                ("GetTask", _) => {
                    let task = held.lock().unwrap().clone();
                    return rpc_answer(&id, "result", task);
                }
                ("SendStreamingMessage", false) => {
                    let working = json!({"id": "up-1", "contextId": "up-ctx",
                        "status": {"state": "TASK_STATE_WORKING"}});
                    events.push((0, json!({"task": working})));
                    events.push((
                        0,
                        json!({"statusUpdate": {"taskId": "up-1", "contextId": "up-ctx",
                        "status": {"state": "TASK_STATE_AUTH_REQUIRED"}}}),
                    ));
                    if at_auth == AtAuth::GoesOnOutOfBand {
                        let done = complete();
                        held.lock().unwrap()["status"]["state"] = json!("TASK_STATE_AUTH_REQUIRED");
                        events.push((100, json!({"task": done})));
                    }
                }
                (_, true) if at_auth == AtAuth::RefusesInItsStream => {
                    let error = json!({"code": -32602, "message": "that is no credential"});
                    if method == "SendMessage" {
                        return rpc_answer(&id, "error", error);
                    }
                    let frame = json!({"jsonrpc": "2.0", "id": id, "error": error});
                    let sse = [(header::CONTENT_TYPE, "text/event-stream")];
                    return (sse, format!("data: {frame}\n\n")).into_response();
                }
                (_, true) => {
                    let task = if at_auth == AtAuth::AsksAgain {
                        held.lock().unwrap().clone()
                    } else {
                        complete()
                    };
                    if method == "SendMessage" {
                        return rpc_answer(&id, "result", json!({"task": task}));
                    }
                    events.push((0, json!({"task": task})));
                }
                _ => {}
            }
            let (sender, frames) = tokio::sync::mpsc::channel(4);
            let held = held.clone();
            tokio::spawn(async move {
                for (delay, event) in events {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                    if event["task"]["status"]["state"] == "TASK_STATE_COMPLETED" {
                        held.lock().unwrap()["status"]["state"] = json!("TASK_STATE_COMPLETED");
                    }
                    let _ = sender.send(sse_frame(&id, event)).await;
                }
            });
            let body =
                axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(frames));
            ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
        }
    });
    let url = serve_on_loopback(app).await;
    (format!("{url}/a2a"), called)
}

/// Waits until the follower of an [`auth_agent`]'s task polls: its stream
/// has ended.
async fn polled_once_its_stream_ended(called: &Mutex<Vec<String>>) {
    let polled = || {
        called
            .lock()
            .unwrap()
            .iter()
            .any(|method| method == "GetTask")
    };
    wait_until("a poll", polled).await;
}

/// A gateway in front of an [`auth_agent`] doing `at_auth`, and a task
/// there at AUTH_REQUIRED: the gateway, the task's id, and the methods the
/// agent was called with.
async fn task_at_auth_required(at_auth: AtAuth) -> (TestBaton, String, Arc<Mutex<Vec<String>>>) {
    let (url, called) = auth_agent(at_auth).await;
    let gateway = gateway_for(card_at(&url, true), fast_upstream()).await;
    let first = gateway
        .send_text(&message_id("m"), "start", json!({}))
        .await;
    let task = &first["task"];
    assert_eq!(
        task["status"]["state"], "TASK_STATE_AUTH_REQUIRED",
        "{first}"
    );
    let task_id = task["id"].as_str().unwrap().to_string();
    (gateway, task_id, called)
}

#[tokio::test]
async fn an_agent_at_auth_required_is_followed_until_it_goes_on() {
    let (gateway, task_id, _) = task_at_auth_required(AtAuth::GoesOnOutOfBand).await;
    // The credential came out of band; no message was sent.
    let task = gateway
        .wait_for_state("/a2a", &task_id, "TASK_STATE_COMPLETED")
        .await;
    assert_eq!(part_texts(&task["artifacts"][0]), ["signed in"]);
    gateway.stop().await;
}

#[tokio::test]
async fn a_message_to_a_task_at_auth_required_reopens_the_agents_ended_stream() {
    let (gateway, task_id, called) = task_at_auth_required(AtAuth::TakesAMessage).await;
    polled_once_its_stream_ended(&called).await;

    let reply = send_more(&gateway, &task_id, "here you are").await;
    let task = &reply.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(part_texts(&task["artifacts"][0]), ["signed in"]);
    let history = history_texts(task);
    assert_eq!(history, ["start", "here you are"]);
    // The follower polled once the stream ended; the message opened the
    // next stream, again the task's only one.
    let called = called.lock().unwrap().clone();
    let sends: Vec<&String> = called.iter().filter(|m| *m != "GetTask").collect();
    assert_eq!(sends, ["SendStreamingMessage", "SendStreamingMessage"]);
    gateway.stop().await;
}

#[tokio::test]
async fn an_agent_asking_again_after_a_message_to_its_auth_required_task_is_heard() {
    let (gateway, task_id, _) = task_at_auth_required(AtAuth::AsksAgain).await;
    let reply = send_more(&gateway, &task_id, "wrong one").await;
    let task = &reply.result()["task"];
    // WORKING once the message went, then asked again.
    assert_eq!(
        task["status"]["state"], "TASK_STATE_AUTH_REQUIRED",
        "{task}"
    );
    assert_eq!(task["history"].as_array().unwrap().len(), 2);
    gateway.stop().await;
}

#[tokio::test]
async fn a_message_refused_in_the_stream_it_opens_is_its_senders_error_and_the_task_goes_on() {
    let (gateway, task_id, called) = task_at_auth_required(AtAuth::RefusesInItsStream).await;
    polled_once_its_stream_ended(&called).await;
    let reply = send_more(&gateway, &task_id, "not one").await;
    assert_eq!(reply.code(), Some(-32602), "{:?}", reply.body);
    let record = gateway.gateway.ledger().get(&task_id).unwrap().unwrap();
    assert_eq!(record.task.status.state, TaskState::AuthRequired);
    assert_eq!(
        record.task.history.len(),
        1,
        "the refused message is not the task's"
    );
    gateway.stop().await;
}

#[tokio::test]
async fn a_follow_up_the_task_could_not_record_never_reaches_the_agent() {
    let (url, seen) = chunking_agent(OnFollowUp::Chunk).await;
    let gateway = baton()
        .agent("remote", remote(card_at(&url, true), fast_upstream()))
        .default_agent("remote")
        .tune(|settings| settings.max_task_bytes = 16 * 1024)
        .start()
        .await;
    let task_id = working_task_with_a_chunk(&gateway).await;
    let long = "x".repeat(20 * 1024);
    let reply = send_more(&gateway, &task_id, &long).await;
    assert_eq!(reply.code(), Some(-32602), "{:?}", reply.body);
    let methods: Vec<Value> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|r| r["method"].clone())
        .collect();
    assert_eq!(methods, ["SendStreamingMessage"], "the agent never got it");
    gateway.stop().await;
}

/// A source agent whose one task, `up-1`, hands the work to echo (for its
/// result if it `returns`) with the payload in an artifact, written with a
/// WORKING status before it, and a moment later leaves its own task
/// INPUT_REQUIRED on the same stream; a result coming back completes it.
/// Returns its URL and the requests it got.
async fn source_pausing_after_its_payload(returns: bool) -> (String, Arc<Mutex<Vec<Value>>>) {
    let sent = Arc::new(Mutex::new(Vec::new()));
    let recorder = sent.clone();
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
        use axum::response::IntoResponse;
        let recorder = recorder.clone();
        async move {
            let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            recorder.lock().unwrap().push(request.clone());
            let id = request["id"].clone();
            if request["method"] == "CancelTask" {
                let canceled = json!({"id": "up-1", "contextId": "up-ctx",
                    "status": {"state": "TASK_STATE_CANCELED"}});
                return rpc_answer(&id, "result", canceled);
            }
            let task = |state: &str| {
                json!({"task": {"id": "up-1", "contextId": "up-ctx", "status": {"state": state}}})
            };
            // Each write: after a delay in ms, its events.
            let mut writes = Vec::new();
            if request["params"]["message"]["taskId"].as_str().unwrap_or_default().is_empty() {
                let payload = handoff_payload("remote", json!({"to": "echo"}), json!({"returnToParent": returns}));
                writes.push((0, vec![task("TASK_STATE_WORKING")]));
                // A state before the payload is no answer to where it leaves the task.
                let on_it = json!({"messageId": "on-it", "role": "ROLE_AGENT", "parts": [{"text": "on it"}]});
                writes.push((0, vec![
                    json!({"statusUpdate": {"taskId": "up-1", "contextId": "up-ctx",
                        "status": {"state": "TASK_STATE_WORKING", "message": on_it}}}),
                    json!({"artifactUpdate": {"taskId": "up-1", "contextId": "up-ctx",
                        "artifact": {"artifactId": "h1", "parts": [handoff_part(payload)]}}}),
                ]));
                writes.push((10, vec![json!({"statusUpdate": {"taskId": "up-1", "contextId": "up-ctx",
                    "status": {"state": "TASK_STATE_INPUT_REQUIRED"}}})]));
            } else {
                writes.push((0, vec![task("TASK_STATE_COMPLETED")]));
            }
            let (sender, frames) = tokio::sync::mpsc::channel(4);
            tokio::spawn(async move {
                for (delay, events) in writes {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                    let frames: Result<String, _> =
                        events.into_iter().map(|event| sse_frame(&id, event)).collect();
                    let _ = sender.send(frames).await;
                }
            });
            let body =
                axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(frames));
            ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
        }
    });
    let url = serve_on_loopback(app).await;
    (format!("{url}/a2a"), sent)
}

/// A gateway for the agent at `url` (`streaming` or polled), which is sent
/// a message and followed until its task completes.
async fn run_to_completion(url: &str, streaming: bool) -> TestBaton {
    let gateway = gateway_for(card_at(url, streaming), fast_upstream()).await;
    let first = gateway
        .send_text(&message_id("m"), "start", json!({}))
        .await;
    let task_id = first["task"]["id"].as_str().unwrap();
    gateway
        .wait_for_state("/a2a", task_id, "TASK_STATE_COMPLETED")
        .await;
    gateway
}

#[tokio::test]
async fn a_result_returns_to_the_task_its_source_paused_just_after_handing_off() {
    let (url, sent) = source_pausing_after_its_payload(true).await;
    let _gateway = run_to_completion(&url, true).await;
    let sent = sent.lock().unwrap().clone();
    assert_eq!(sent.len(), 2, "{sent:?}");
    // The return leg continued the source's paused task, not a new one.
    let returned = &sent[1]["params"]["message"];
    assert_eq!(returned["taskId"], "up-1", "{returned}");
}

/// A polled source whose snapshot carries its payload with its task still
/// WORKING, the state it was in, hands over at once: the state is the one
/// the snapshot says. Its task went on being polled for half a second,
/// waiting for a change of state that never came.
#[tokio::test]
async fn a_transfer_in_a_polled_snapshot_takes_the_state_it_came_with() {
    let sent = Arc::new(Mutex::new(Vec::new()));
    let recorder = sent.clone();
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
        let recorder = recorder.clone();
        async move {
            let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            recorder.lock().unwrap().push(request["method"].clone());
            let mut task = json!({"id": "up-1", "contextId": "up-ctx",
                "status": {"state": "TASK_STATE_WORKING"}});
            match request["method"].as_str() {
                Some("GetTask") => {
                    let payload = handoff_payload("remote", json!({"to": "echo"}), json!({}));
                    task["artifacts"] =
                        json!([{"artifactId": "h1", "parts": [handoff_part(payload)]}]);
                }
                Some("CancelTask") => task["status"]["state"] = json!("TASK_STATE_CANCELED"),
                _ => task = json!({"task": task}),
            }
            rpc_answer(&request["id"], "result", task)
        }
    });
    let url = format!("{}/a2a", serve_on_loopback(app).await);
    let gateway = run_to_completion(&url, false).await;
    let polls = sent
        .lock()
        .unwrap()
        .iter()
        .filter(|m| *m == "GetTask")
        .count();
    assert_eq!(polls, 1, "{:?}", sent.lock().unwrap());
    gateway.stop().await;
}

#[tokio::test]
async fn a_task_its_source_left_paused_handing_on_for_good_is_canceled_at_the_source() {
    let (url, got) = source_pausing_after_its_payload(false).await;
    let _gateway = run_to_completion(&url, true).await;
    let canceled = || {
        let got = got.lock().unwrap();
        got.iter()
            .any(|r| r["method"] == "CancelTask" && r["params"]["id"] == "up-1")
    };
    wait_until("CancelTask for the source's paused task", canceled).await;
}
