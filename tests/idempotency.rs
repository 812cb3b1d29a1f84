//! Idempotent sends (DESIGN.md §2): with an `Idempotency-Key` header, or
//! with the handoff extension active (the messageId is then the key), a
//! repeated send with the same key and message returns what the first send
//! created; the same key with another message is -32602; without either,
//! every send is new.

mod common;

use common::agents::GatedAgent;
use common::*;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const SCENARIO: &str = "/agents/scenario/a2a";
const HANDOFF: &str = "urn:baton:handoff:v1";

/// Posts a JSON-RPC call with the standard headers plus `extra`.
async fn call_with(
    baton: &TestBaton,
    path: &str,
    method: &str,
    params: Value,
    extra: &[(&str, &str)],
) -> Reply {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let mut headers = STANDARD_HEADERS.to_vec();
    headers.extend_from_slice(extra);
    baton.post_raw(path, body.to_string(), &headers).await
}

/// SendMessage with an `Idempotency-Key`.
async fn send_keyed(baton: &TestBaton, path: &str, key: &str, params: Value) -> Reply {
    call_with(
        baton,
        path,
        "SendMessage",
        params,
        &[("idempotency-key", key)],
    )
    .await
}

/// SendStreamingMessage with extra headers, read to its end.
async fn stream_with(
    baton: &TestBaton,
    path: &str,
    params: Value,
    extra: &[(&str, &str)],
) -> SseReply {
    let body =
        json!({"jsonrpc": "2.0", "id": 7, "method": "SendStreamingMessage", "params": params});
    let mut request = baton
        .http
        .post(baton.url(path))
        .header("accept", "text/event-stream")
        .body(body.to_string());
    for (name, value) in STANDARD_HEADERS.iter().chain(extra) {
        request = request.header(*name, *value);
    }
    let response = tokio::time::timeout(WAIT, request.send())
        .await
        .expect("stream opens in time")
        .expect("HTTP request");
    read_sse(response, 100).await
}

/// SendMessage with an `Idempotency-Key` to `/a2a`, on a task of its own:
/// its reply's body.
fn spawn_send_keyed(
    baton: &TestBaton,
    key: &str,
    params: &Value,
) -> tokio::task::JoinHandle<Value> {
    let request = baton
        .http
        .post(baton.url("/a2a"))
        .header("content-type", "application/json")
        .header("a2a-version", "1.0")
        .header("idempotency-key", key)
        .body(
            json!({"jsonrpc": "2.0", "id": 5, "method": "SendMessage", "params": params})
                .to_string(),
        );
    tokio::spawn(async move { request.send().await.unwrap().json::<Value>().await.unwrap() })
}

fn task_id(reply: &Reply) -> String {
    reply.result()["task"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no task in {}", reply.body))
        .to_string()
}

/// ListTasks `totalSize` and the ids on the first page.
async fn listed(baton: &TestBaton) -> (i64, Vec<String>) {
    let reply = baton.call("ListTasks", json!({"pageSize": 100})).await;
    let result = reply.result();
    let ids = result["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap().to_string())
        .collect();
    (result["totalSize"].as_i64().unwrap(), ids)
}

/// The task id of a stream event (any kind).
fn stream_task_id(event: &Value) -> &str {
    let result = &event["result"];
    result["task"]["id"]
        .as_str()
        .or(result["statusUpdate"]["taskId"].as_str())
        .or(result["artifactUpdate"]["taskId"].as_str())
        .unwrap_or_else(|| panic!("stream event without a task id: {event}"))
}

fn fresh_key() -> String {
    format!("key-{}", uuid::Uuid::new_v4())
}

#[tokio::test]
async fn same_key_and_message_return_the_first_task() {
    let baton = baton().start().await;
    let key = fresh_key();
    let params = json!({"message": user_message(&message_id("tck-complete-task"), "hello")});
    let first = send_keyed(&baton, SCENARIO, &key, params.clone()).await;
    let second = send_keyed(&baton, SCENARIO, &key, params.clone()).await;
    assert_eq!(task_id(&first), task_id(&second));
    assert_eq!(
        second.result(),
        first.result(),
        "the replay is the same task"
    );
    assert_eq!(
        second.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );

    let (total, ids) = listed(&baton).await;
    assert_eq!(total, 1);
    assert_eq!(ids, [task_id(&first)]);
    // The message reached the agent once: one user message in the history.
    let task = baton
        .call("GetTask", json!({"id": task_id(&first)}))
        .await
        .result()
        .clone();
    let user_turns = task["history"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "ROLE_USER")
        .count();
    assert_eq!(user_turns, 1, "{task}");

    // Another key with the same message is a new send.
    let third = send_keyed(&baton, SCENARIO, &fresh_key(), params).await;
    assert_ne!(task_id(&third), task_id(&first));
    assert_eq!(listed(&baton).await.0, 2);
    baton.stop().await;
}

#[tokio::test]
async fn same_key_with_another_message_is_refused() {
    let baton = baton().start().await;
    let key = fresh_key();
    let id = message_id("tck-complete-task");
    let first = send_keyed(
        &baton,
        SCENARIO,
        &key,
        json!({"message": user_message(&id, "hello")}),
    )
    .await;
    task_id(&first);

    // Same messageId, other text; other messageId, same text.
    for message in [
        user_message(&id, "goodbye"),
        user_message(&message_id("tck-complete-task"), "hello"),
    ] {
        let reply = send_keyed(&baton, SCENARIO, &key, json!({"message": message})).await;
        assert_eq!(reply.code(), Some(-32602), "{}", reply.body);
        let streamed = call_with(
            &baton,
            SCENARIO,
            "SendStreamingMessage",
            json!({"message": message}),
            &[("idempotency-key", &key)],
        )
        .await;
        assert_eq!(streamed.code(), Some(-32602), "{}", streamed.body);
    }
    assert_eq!(listed(&baton).await.0, 1);
    baton.stop().await;
}

#[tokio::test]
async fn without_a_key_every_send_is_new() {
    let baton = baton().start().await;
    let params = json!({"message": user_message(&message_id("tck-complete-task"), "hello")});
    let first = baton.call_at(SCENARIO, "SendMessage", params.clone()).await;
    let second = baton.call_at(SCENARIO, "SendMessage", params.clone()).await;
    assert_ne!(task_id(&first), task_id(&second));
    // The same messageId with other content is fine too.
    let mut other = params.clone();
    other["message"]["parts"][0]["text"] = json!("something else");
    let third = baton.call_at(SCENARIO, "SendMessage", other).await;
    let (total, ids) = listed(&baton).await;
    assert_eq!(total, 3);
    for reply in [&first, &second, &third] {
        assert!(ids.contains(&task_id(reply)));
    }
    baton.stop().await;
}

#[tokio::test]
async fn a_blank_key_is_no_key() {
    let baton = baton().start().await;
    let mut tasks = Vec::new();
    for (key, text) in [("", "one"), ("", "two"), (" ", "three")] {
        let params = json!({"message": user_message(&message_id("tck-complete-task"), text)});
        let reply = send_keyed(&baton, SCENARIO, key, params).await;
        tasks.push(task_id(&reply));
    }
    tasks.dedup();
    assert_eq!(tasks.len(), 3, "each send is new: {tasks:?}");
    baton.stop().await;
}

#[tokio::test]
async fn with_the_handoff_extension_the_message_id_is_the_key() {
    let baton = baton().start().await;
    let extension = [("a2a-extensions", HANDOFF)];
    let id = message_id("tck-complete-task");
    let params = json!({"message": user_message(&id, "hello")});
    let first = call_with(&baton, SCENARIO, "SendMessage", params.clone(), &extension).await;
    let second = call_with(&baton, SCENARIO, "SendMessage", params.clone(), &extension).await;
    assert_eq!(task_id(&first), task_id(&second));
    assert!(
        first
            .headers
            .get("a2a-extensions")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains(HANDOFF)),
        "the extension is reported active: {:?}",
        first.headers
    );
    assert_eq!(listed(&baton).await.0, 1);

    // The same messageId with another message is refused.
    let other = json!({"message": user_message(&id, "different")});
    let refused = call_with(&baton, SCENARIO, "SendMessage", other, &extension).await;
    assert_eq!(refused.code(), Some(-32602), "{}", refused.body);
    assert_eq!(listed(&baton).await.0, 1);

    // Without the extension the messageId is no key.
    let plain = baton.call_at(SCENARIO, "SendMessage", params).await;
    assert_ne!(task_id(&plain), task_id(&first));
    assert_eq!(listed(&baton).await.0, 2);
    baton.stop().await;
}

#[tokio::test]
async fn repeated_streaming_send_streams_the_existing_task() {
    let baton = baton().start().await;
    let key = fresh_key();
    let headers = [("idempotency-key", key.as_str())];
    let params = json!({"message": user_message(&message_id("tck-stream-001"), "stream")});

    let first = stream_with(&baton, SCENARIO, params.clone(), &headers).await;
    assert!(first.closed);
    let task = stream_task_id(&first.events[0]).to_string();
    assert!(first.events.iter().all(|e| stream_task_id(e) == task));
    assert_eq!(
        first.events.last().unwrap()["result"]["statusUpdate"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );

    let again = stream_with(&baton, SCENARIO, params.clone(), &headers).await;
    assert!(again.content_type.starts_with("text/event-stream"));
    assert!(again.closed, "the replay ends with the task");
    assert!(!again.events.is_empty(), "the replay streams the task");
    assert!(
        again.events.iter().all(|e| stream_task_id(e) == task),
        "{:#?}",
        again.events
    );
    let snapshot = &again.events[0]["result"]["task"];
    assert_eq!(snapshot["id"], task.as_str());
    assert_eq!(snapshot["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(
        snapshot["artifacts"][0]["parts"][0]["text"],
        "Stream hello from TCK"
    );

    // SendMessage with the same key and message answers the same task.
    let unary = send_keyed(&baton, SCENARIO, &key, params).await;
    assert_eq!(task_id(&unary), task);
    assert_eq!(listed(&baton).await, (1, vec![task]));
    baton.stop().await;
}

#[tokio::test]
async fn repeated_streaming_send_follows_a_running_task() {
    let gated = GatedAgent::new();
    let baton = baton().agent("gated", gated.clone()).start().await;
    let key = fresh_key();
    let params = json!({"tenant": "gated", "message": user_message(&message_id("m"), "work")});

    let open = |baton: &TestBaton| {
        let request = baton
            .http
            .post(baton.url("/a2a"))
            .header("accept", "text/event-stream")
            .header("content-type", "application/json")
            .header("a2a-version", "1.0")
            .header("idempotency-key", key.clone())
            .body(
                json!({"jsonrpc": "2.0", "id": 3, "method": "SendStreamingMessage",
                       "params": params})
                .to_string(),
            );
        tokio::spawn(async move { read_sse(request.send().await.unwrap(), 100).await })
    };
    let first = open(&baton);
    let start = Instant::now();
    let task = loop {
        let (_, ids) = listed(&baton).await;
        if let Some(id) = ids.first() {
            break id.clone();
        }
        assert!(start.elapsed() < WAIT, "the first stream made no task");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let second = open(&baton);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(listed(&baton).await, (1, vec![task.clone()]));

    // One release finishes the one task; both streams end with it.
    gated.release(1);
    for stream in [first, second] {
        let reply = tokio::time::timeout(WAIT, stream).await.unwrap().unwrap();
        assert!(reply.closed);
        assert!(reply.events.iter().all(|e| stream_task_id(e) == task));
        assert_eq!(reply.events[0]["result"]["task"]["id"], task.as_str());
        assert_eq!(
            reply.events.last().unwrap()["result"]["statusUpdate"]["status"]["state"],
            "TASK_STATE_COMPLETED"
        );
    }
    assert_eq!(listed(&baton).await.0, 1);
    baton.stop().await;
}

#[tokio::test]
async fn a_replayed_message_reply_is_the_same_message() {
    let baton = baton().start().await;
    let key = fresh_key();
    let params = json!({"message": user_message(&message_id("tck-message-response"), "hi")});
    let first = send_keyed(&baton, SCENARIO, &key, params.clone()).await;
    let message = first.result()["message"].clone();
    assert_eq!(message["parts"][0]["text"], "Direct message response");
    assert!(message["messageId"].as_str().is_some_and(|m| !m.is_empty()));

    let second = send_keyed(&baton, SCENARIO, &key, params.clone()).await;
    assert_eq!(second.result(), &json!({"message": message}));

    let streamed = stream_with(
        &baton,
        SCENARIO,
        params,
        &[("idempotency-key", key.as_str())],
    )
    .await;
    assert_eq!(streamed.events.len(), 1, "{:#?}", streamed.events);
    assert_eq!(streamed.events[0]["result"], json!({"message": message}));
    assert_eq!(listed(&baton).await.0, 0, "a message reply makes no task");
    baton.stop().await;
}

#[tokio::test]
async fn concurrent_repeats_make_one_task() {
    let baton = baton().start().await;
    let key = fresh_key();
    let params = json!({"message": user_message(&message_id("tck-complete-task"), "race")});
    let replies = futures::future::join_all(
        (0..8).map(|_| send_keyed(&baton, SCENARIO, &key, params.clone())),
    )
    .await;
    let first = task_id(&replies[0]);
    for reply in &replies {
        assert_eq!(task_id(reply), first);
    }
    assert_eq!(listed(&baton).await, (1, vec![first]));
    baton.stop().await;
}

#[tokio::test]
async fn a_blocking_repeat_waits_like_the_first_send() {
    let gated = GatedAgent::new();
    let baton = baton().agent("gated", gated.clone()).start().await;
    let key = fresh_key();
    let params = json!({"tenant": "gated", "message": user_message(&message_id("m"), "slow")});

    // The first blocking send is in flight (a client that then times out and retries).
    let send = |baton: &TestBaton| spawn_send_keyed(baton, &key, &params);
    let first = send(&baton);
    let start = Instant::now();
    while listed(&baton).await.0 == 0 {
        assert!(start.elapsed() < WAIT, "the first send made no task");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let retry = send(&baton);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let retry_early = retry.is_finished();

    gated.release(1);
    let first = tokio::time::timeout(WAIT, first).await.unwrap().unwrap();
    let retry = tokio::time::timeout(WAIT, retry).await.unwrap().unwrap();
    assert_eq!(
        first["result"]["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    assert_eq!(retry["result"]["task"]["id"], first["result"]["task"]["id"]);
    assert!(
        !retry_early,
        "a blocking repeat returned before the task settled: {retry}"
    );
    assert_eq!(
        retry["result"]["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    assert_eq!(listed(&baton).await.0, 1);
    baton.stop().await;
}

/// A repeat during a first send whose agent takes longer than a few
/// seconds to answer waits for it, however long (up to the task timeout):
/// it was answered -32603 after 5 s.
#[tokio::test]
async fn a_repeat_waits_for_a_first_send_slow_to_get_its_first_answer() {
    let gated = GatedAgent::quiet();
    let baton = baton().agent("gated", gated.clone()).start().await;
    let key = fresh_key();
    let params = json!({"tenant": "gated", "message": user_message(&message_id("m"), "slow")});
    let first = spawn_send_keyed(&baton, &key, &params);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let repeat = spawn_send_keyed(&baton, &key, &params);
    tokio::time::sleep(Duration::from_millis(5500)).await;
    assert_eq!(listed(&baton).await.0, 0, "no answer yet, no task");
    gated.release(1);
    let first = tokio::time::timeout(WAIT, first).await.unwrap().unwrap();
    let repeat = tokio::time::timeout(WAIT, repeat).await.unwrap().unwrap();
    assert!(repeat.get("error").is_none(), "{repeat}");
    assert_eq!(
        repeat["result"]["task"]["id"],
        first["result"]["task"]["id"]
    );
    assert_eq!(
        first["result"]["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    assert_eq!(listed(&baton).await.0, 1);
    baton.stop().await;
}

/// A send whose driver panicked (a gateway bug) lets its idempotency key
/// go: the repeat runs, instead of waiting on a claim no one fills.
#[tokio::test]
async fn a_repeat_takes_over_the_key_of_a_send_that_panicked() {
    let agent = common::agents::PanicsOnceAgent::new();
    let baton = baton().agent("panics", agent).start().await;
    let key = fresh_key();
    let params = json!({"tenant": "panics", "message": user_message(&message_id("m"), "x")});
    let first = send_keyed(&baton, "/a2a", &key, params.clone()).await;
    assert_eq!(first.code(), Some(-32603), "{}", first.body);
    let started = Instant::now();
    let again = send_keyed(&baton, "/a2a", &key, params).await;
    let took = started.elapsed();
    assert_eq!(
        again.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED",
        "took {took:?}: {}",
        again.body
    );
    assert!(took < Duration::from_secs(2), "the repeat took {took:?}");
    assert_eq!(listed(&baton).await.0, 1);
    baton.stop().await;
}

#[tokio::test]
async fn a_repeated_answer_to_a_paused_task_returns_the_task() {
    let baton = baton().start().await;
    let task = open_paused_task(&baton).await;

    let key = fresh_key();
    let answer = user_message_on(&task, &message_id("tck-complete-task"), "the answer");
    let params = json!({"message": answer});
    let first = send_keyed(&baton, SCENARIO, &key, params.clone()).await;
    assert_eq!(task_id(&first), task);
    assert_eq!(
        first.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    // The answer is sent again (a lost reply): the first send's outcome,
    // not "task is terminal".
    let again = send_keyed(&baton, SCENARIO, &key, params).await;
    assert!(
        again.body.get("error").is_none(),
        "a repeated answer was refused: {}",
        again.body
    );
    assert_eq!(task_id(&again), task);
    assert_eq!(
        again.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    let history = baton.call("GetTask", json!({"id": task})).await;
    let user_turns = history.result()["history"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "ROLE_USER")
        .count();
    assert_eq!(user_turns, 2, "the answer was recorded once");
    baton.stop().await;
}

#[tokio::test]
async fn a_repeat_of_a_failed_send_answers_like_the_first() {
    let failing = common::agents::FailingAgent(common::agents::card("failing"));
    let baton = baton().agent("failing", failing).start().await;
    let key = fresh_key();
    let params = json!({"tenant": "failing", "message": user_message(&message_id("m"), "x")});
    let first = send_keyed(&baton, "/a2a", &key, params.clone()).await;
    assert!(first.code().is_some(), "{}", first.body);
    // The first send created nothing; its retry must not hang on a key
    // that no task or message will ever fill.
    let started = Instant::now();
    let again = send_keyed(&baton, "/a2a", &key, params).await;
    let took = started.elapsed();
    assert_eq!(again.body["error"], first.body["error"], "took {took:?}");
    assert!(took < Duration::from_secs(2), "the repeat took {took:?}");
    assert_eq!(listed(&baton).await.0, 0);
    baton.stop().await;
}

#[tokio::test]
async fn an_answer_refused_for_its_size_releases_its_key() {
    let baton = baton()
        .tune(|settings| settings.max_task_bytes = 1024 * 1024)
        .start()
        .await;
    let task = open_paused_task(&baton).await;
    let key = fresh_key();
    let long = "x".repeat(1024 * 1024);
    let answer = user_message_on(&task, &message_id("tck-complete-task"), &long);
    let refused = send_keyed(&baton, SCENARIO, &key, json!({"message": answer})).await;
    assert_eq!(refused.code(), Some(-32602), "{}", refused.body);
    // The key is free again: another message under it is taken, not a
    // conflict with the refused one.
    let answer = user_message_on(&task, &message_id("tck-complete-task"), "short");
    let taken = send_keyed(&baton, SCENARIO, &key, json!({"message": answer})).await;
    assert_eq!(
        taken.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED",
        "{}",
        taken.body
    );
    baton.stop().await;
}

/// Opens a task the scenario agent leaves INPUT_REQUIRED; its id.
async fn open_paused_task(baton: &TestBaton) -> String {
    let message = user_message(&message_id("tck-input-required"), "ask");
    let opened = baton
        .call_at(SCENARIO, "SendMessage", json!({"message": message}))
        .await;
    assert_eq!(
        opened.result()["task"]["status"]["state"],
        "TASK_STATE_INPUT_REQUIRED"
    );
    task_id(&opened)
}
