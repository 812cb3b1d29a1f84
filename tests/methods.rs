//! The success path of every A2A method over real HTTP, plus blocking versus
//! returnImmediately, multi-turn, and SSE fan-out to several subscribers.

mod common;

use baton::gateway::GatewaySettings;
use common::agents::{BindsInLargeReport, BurstAgent, ChattyAgent, GatedAgent, card};
use common::*;
use serde_json::{Value, json};

#[tokio::test]
async fn send_message_blocks_until_completed() {
    let baton = baton().start().await;
    let result = baton.send_text(&message_id("m"), "hello", json!({})).await;
    let task = &result["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(task["artifacts"][0]["parts"][0]["text"], "hello");
    assert!(task["contextId"].as_str().is_some_and(|c| !c.is_empty()));
    assert_eq!(task["history"][0]["role"], "ROLE_USER");
    baton.stop().await;
}

#[tokio::test]
async fn return_immediately_does_not_wait_for_the_agent() {
    let gated = GatedAgent::new();
    let baton = baton().agent("gated", gated.clone()).start().await;
    let params = json!({
        "tenant": "gated",
        "message": user_message(&message_id("m"), "work"),
        "configuration": {"returnImmediately": true},
    });
    let reply = baton.call("SendMessage", params).await;
    let task = reply.result()["task"].clone();
    let state = task["status"]["state"].as_str().unwrap();
    assert!(
        state == "TASK_STATE_SUBMITTED" || state == "TASK_STATE_WORKING",
        "{state}"
    );

    // A blocking send on the same agent waits until the gate opens.
    let blocking = {
        let params = json!({"tenant": "gated", "message": user_message(&message_id("m"), "wait")});
        let baton_url = baton.url("/a2a");
        let http = baton.http.clone();
        tokio::spawn(async move {
            let body =
                json!({"jsonrpc": "2.0", "id": 9, "method": "SendMessage", "params": params});
            let mut request = http.post(baton_url).body(body.to_string());
            for (name, value) in STANDARD_HEADERS {
                request = request.header(name, value);
            }
            request.send().await.unwrap().json::<Value>().await.unwrap()
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(
        !blocking.is_finished(),
        "blocking send returned before the task settled"
    );
    gated.release(2);
    let reply = tokio::time::timeout(WAIT, blocking).await.unwrap().unwrap();
    assert_eq!(
        reply["result"]["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );

    let got = baton.call("GetTask", json!({"id": task["id"]})).await;
    assert_eq!(got.result()["status"]["state"], "TASK_STATE_COMPLETED");
    baton.stop().await;
}

#[tokio::test]
async fn streaming_send_frames_each_event_as_a_jsonrpc_response() {
    let baton = baton().default_agent("scenario").start().await;
    let params = json!({"message": user_message(&message_id("tck-stream-001"), "go")});
    let reply = baton
        .stream_at("/a2a", "SendStreamingMessage", params, 100)
        .await;
    assert!(reply.content_type.starts_with("text/event-stream"));
    assert!(reply.closed, "the stream ends after the terminal event");
    let results: Vec<&Value> = reply.events.iter().map(|e| &e["result"]).collect();
    assert!(
        reply
            .events
            .iter()
            .all(|e| e["jsonrpc"] == "2.0" && e["id"].is_u64())
    );
    assert!(
        results[0]["task"]["id"].is_string(),
        "the first event is the task"
    );
    let task_id = results[0]["task"]["id"].as_str().unwrap();
    let kinds: Vec<&str> = results
        .iter()
        .map(|r| r.as_object().unwrap().keys().next().unwrap().as_str())
        .collect();
    assert_eq!(
        kinds,
        ["task", "statusUpdate", "artifactUpdate", "statusUpdate"]
    );
    assert_eq!(
        results[2]["artifactUpdate"]["artifact"]["parts"][0]["text"],
        "Stream hello from TCK"
    );
    assert_eq!(
        results[3]["statusUpdate"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    assert!(results[1..].iter().all(|r| {
        let event = r.as_object().unwrap().values().next().unwrap();
        event["taskId"] == task_id
    }));

    // A message-only reply is one `message` event, then the end.
    let params = json!({"message": user_message(&message_id("tck-message-response"), "hi")});
    let reply = baton
        .stream_at("/a2a", "SendStreamingMessage", params, 100)
        .await;
    assert!(reply.closed);
    assert_eq!(reply.events.len(), 1);
    assert_eq!(
        reply.events[0]["result"]["message"]["parts"][0]["text"],
        "Direct message response"
    );
    baton.stop().await;
}

#[tokio::test]
async fn a_stream_gets_a_burst_of_several_writes_whole_and_in_order() {
    // 200 events reach the ledger in writes of up to 65 (the driver's agent
    // channel of 64, and the snapshot), published back to back; whether the
    // stream keeps up or replays from the ledger, it must see each once.
    let chunks = 200;
    let burst = BurstAgent {
        artifacts: chunks,
        card: card("burst"),
    };
    let baton = baton().agent("burst", burst).start().await;
    let params = json!({"message": user_message(&message_id("m"), "burst")});
    let reply = baton
        .stream_at("/agents/burst/a2a", "SendStreamingMessage", params, 1000)
        .await;
    assert!(reply.closed, "the stream ends after the terminal event");
    let results: Vec<&Value> = reply.events.iter().map(|e| &e["result"]).collect();
    assert_eq!(
        results.len(),
        chunks + 2,
        "snapshot, every chunk, completion"
    );
    assert!(results[0]["task"]["id"].is_string());
    let ids: Vec<&str> = results[1..=chunks]
        .iter()
        .map(|r| {
            r["artifactUpdate"]["artifact"]["artifactId"]
                .as_str()
                .unwrap()
        })
        .collect();
    let expected: Vec<String> = (0..chunks).map(|chunk| format!("chunk-{chunk}")).collect();
    assert_eq!(ids, expected);
    assert_eq!(
        results[chunks + 1]["statusUpdate"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    baton.stop().await;
}

/// A stream of a task read by a test from the ledger.
type LedgerStream = futures::stream::BoxStream<
    'static,
    Result<std::sync::Arc<baton::store::hub::LedgerEvent>, baton::error::GatewayError>,
>;

/// A WORKING task `task_id` made in `baton`'s ledger, and its stream from
/// its snapshot over a blocking send's channel (32 events), opened before
/// any later event: it falls behind once more are published unread.
async fn task_with_lagging_stream(
    baton: &TestBaton,
    task_id: &str,
    context_id: &str,
) -> (std::sync::Arc<baton::store::TaskRecord>, LedgerStream) {
    use baton::gateway::TaskEventStream;
    use baton::protocol::{StreamResponse, Task, TaskState, TaskStatus};
    let task = Task {
        id: task_id.into(),
        context_id: context_id.into(),
        status: TaskStatus::now(TaskState::Working, None),
        ..Task::default()
    };
    let record = baton::store::TaskRecord {
        task: task.clone(),
        owner: "anonymous".into(),
        agent: "echo".into(),
        ..baton::store::TaskRecord::default()
    };
    let record = baton
        .ledger
        .create(record, vec![StreamResponse::Task(task)])
        .await
        .unwrap();
    let watcher = baton.ledger.hub().watch_outcome(task_id);
    let stream = TaskEventStream::from_snapshot(baton.gateway.clone(), &record, watcher, false)
        .into_stream();
    (record, stream)
}

/// Writes `event` to task `task_id` in `baton`'s ledger, durably.
async fn append(baton: &TestBaton, task_id: &str, event: baton::protocol::StreamResponse) {
    baton
        .ledger
        .update(task_id, |_| Ok::<_, baton::store::LedgerError>(vec![event]))
        .await
        .unwrap();
}

/// A status update of task `task_id` to `state`.
fn status_event(
    task_id: &str,
    context_id: &str,
    state: baton::protocol::TaskState,
) -> baton::protocol::StreamResponse {
    use baton::protocol::{TaskStatus, TaskStatusUpdateEvent};
    baton::protocol::StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
        task_id: task_id.into(),
        context_id: context_id.into(),
        status: TaskStatus::now(state, None),
        ..TaskStatusUpdateEvent::default()
    })
}

/// `stream`'s next event, within 10 s.
async fn next_of(
    stream: &mut LedgerStream,
) -> Option<std::sync::Arc<baton::store::hub::LedgerEvent>> {
    use futures::StreamExt as _;
    tokio::time::timeout(std::time::Duration::from_secs(10), stream.next())
        .await
        .expect("the stream answers in time")
        .map(|event| event.expect("an event, not an error"))
}

#[tokio::test]
async fn a_stream_that_falls_behind_replays_the_gap_from_the_ledger_in_order() {
    use baton::protocol::{Artifact, Part, StreamResponse, TaskArtifactUpdateEvent, TaskState};

    let baton = baton().start().await;
    let (task_id, context_id) = ("lagging", "lagging-context");
    // More events than the channel holds, published before the stream reads
    // any: it must lag, then replay.
    let (record, mut stream) = task_with_lagging_stream(&baton, task_id, context_id).await;
    let chunks = 100;
    for chunk in 0..chunks {
        let event = StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
            task_id: task_id.into(),
            context_id: context_id.into(),
            artifact: Artifact {
                artifact_id: format!("chunk-{chunk}"),
                parts: vec![Part::text(chunk.to_string())],
                ..Artifact::default()
            },
            ..TaskArtifactUpdateEvent::default()
        });
        append(&baton, task_id, event).await;
    }
    let first = next_of(&mut stream).await.unwrap();
    assert!(matches!(first.event, StreamResponse::Task(_)));
    for chunk in 0..chunks {
        let event = next_of(&mut stream).await.unwrap();
        let StreamResponse::ArtifactUpdate(update) = &event.event else {
            panic!("expected chunk {chunk}, got {:?}", event.event);
        };
        assert_eq!(update.artifact.artifact_id, format!("chunk-{chunk}"));
        assert_eq!(event.seq, record.last_seq + 1 + chunk as u64);
    }
    // Caught up: the next event arrives live, and the stream ends with it.
    let completed = status_event(task_id, context_id, TaskState::Completed);
    append(&baton, task_id, completed).await;
    let last = next_of(&mut stream).await.unwrap();
    assert_eq!(last.event.state(), Some(TaskState::Completed));
    assert!(next_of(&mut stream).await.is_none());
    baton.stop().await;
}

/// A stream further behind than the events its channel kept can prompt
/// replays of (a page of 256 events each) replays page after page with no
/// live event, to the task's end.
#[tokio::test]
async fn a_stream_far_behind_replays_every_page_to_the_end() {
    use baton::protocol::TaskState;

    let baton = baton().start().await;
    let (task_id, context_id) = ("far-behind", "far-behind-context");
    let (record, mut stream) = task_with_lagging_stream(&baton, task_id, context_id).await;
    // Its lag and the 32 events its channel keeps prompt 33 replays, a page
    // each: well past that many pages.
    let updates = 36 * 256;
    for i in 0..updates {
        let state = [TaskState::InputRequired, TaskState::Working][i % 2];
        append(&baton, task_id, status_event(task_id, context_id, state)).await;
    }
    let completed = status_event(task_id, context_id, TaskState::Completed);
    append(&baton, task_id, completed).await;

    let mut seqs = Vec::new();
    let mut last = None;
    while let Some(event) = next_of(&mut stream).await {
        seqs.push(event.seq);
        last = Some(event);
    }
    // The snapshot, then every event in order up to the final snapshot,
    // which stands for the last events when the task ended before they
    // were applied.
    let (end, logged) = seqs.split_last().unwrap();
    let contiguous: Vec<u64> = (record.last_seq..record.last_seq + logged.len() as u64).collect();
    assert_eq!(logged, contiguous);
    assert_eq!(*end, record.last_seq + updates as u64 + 1);
    assert_eq!(last.unwrap().event.state(), Some(TaskState::Completed));
    baton.stop().await;
}

#[tokio::test]
async fn three_subscribers_see_identical_ordered_events() {
    let gated = GatedAgent::new();
    let baton = baton().agent("gated", gated.clone()).start().await;
    let params = json!({
        "tenant": "gated",
        "message": user_message(&message_id("m"), "fan out"),
        "configuration": {"returnImmediately": true},
    });
    let task_id = baton.call("SendMessage", params).await.result()["task"]["id"]
        .as_str()
        .unwrap()
        .to_string();

    let mut subscribers = Vec::new();
    for _ in 0..3 {
        let response = baton
            .open_stream(
                "/agents/gated/a2a",
                "SubscribeToTask",
                json!({"id": task_id}),
            )
            .await;
        subscribers.push(tokio::spawn(read_sse(response, 100)));
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    gated.release(1);

    let mut streams = Vec::new();
    for subscriber in subscribers {
        let reply = subscriber.await.unwrap();
        assert!(reply.closed);
        // Ids differ per request; everything else must match byte for byte.
        let results: Vec<String> = reply
            .events
            .iter()
            .map(|e| e["result"].to_string())
            .collect();
        streams.push(results);
    }
    assert_eq!(streams[0], streams[1]);
    assert_eq!(streams[1], streams[2]);
    let first: Value = serde_json::from_str(&streams[0][0]).unwrap();
    assert_eq!(
        first["task"]["id"],
        task_id.as_str(),
        "the first event is the current task"
    );
    let last: Value = serde_json::from_str(streams[0].last().unwrap()).unwrap();
    assert_eq!(
        last["statusUpdate"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    assert!(streams[0].iter().any(|e| e.contains("artifactUpdate")));
    baton.stop().await;
}

#[tokio::test]
async fn multi_turn_continues_a_task_in_its_context() {
    let baton = baton().default_agent("scenario").start().await;
    let first = baton
        .send_text(&message_id("tck-input-required"), "book a table", json!({}))
        .await;
    let task = &first["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_INPUT_REQUIRED");
    let (task_id, context_id) = (task["id"].clone(), task["contextId"].clone());

    let answer = user_message_on(&task_id, &message_id("tck-complete-task"), "for two");
    let second = baton.call("SendMessage", json!({"message": answer})).await;
    let task = &second.result()["task"];
    assert_eq!(task["id"], task_id);
    assert_eq!(
        task["contextId"], context_id,
        "the context is inferred from the task"
    );
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED");
    let texts: Vec<&str> = task["history"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["parts"][0]["text"].as_str())
        .collect();
    assert_eq!(
        texts,
        [
            "book a table",
            "Please provide more input.",
            "for two",
            "Hello from TCK"
        ]
    );

    // historyLength caps the history returned.
    let got = baton
        .call("GetTask", json!({"id": task_id, "historyLength": 1}))
        .await;
    assert_eq!(got.result()["history"].as_array().unwrap().len(), 1);
    let got = baton
        .call("GetTask", json!({"id": task_id, "history_length": 0}))
        .await;
    assert!(got.result().get("history").is_none());

    // A client-chosen context is kept; a new task in it is a new id.
    let context = format!("ctx-{}", uuid::Uuid::new_v4());
    let mut message = user_message(&message_id("tck-complete-task"), "again");
    message["contextId"] = json!(context);
    let third = baton.call("SendMessage", json!({"message": message})).await;
    assert_eq!(third.result()["task"]["contextId"], context.as_str());
    baton.stop().await;
}

#[tokio::test]
async fn cancel_moves_a_task_to_canceled() {
    let gated = GatedAgent::new();
    let baton = baton().agent("gated", gated.clone()).start().await;
    let params = json!({
        "tenant": "gated",
        "message": user_message(&message_id("m"), "long job"),
        "configuration": {"returnImmediately": true},
    });
    let task_id = baton.call("SendMessage", params).await.result()["task"]["id"].clone();
    let subscriber = baton
        .open_stream(
            "/a2a",
            "SubscribeToTask",
            json!({"id": task_id, "tenant": "gated"}),
        )
        .await;
    let canceled = baton.call("CancelTask", json!({"id": task_id})).await;
    assert_eq!(canceled.result()["status"]["state"], "TASK_STATE_CANCELED");
    let events = read_sse(subscriber, 100).await;
    assert!(events.closed);
    let last = &events.events.last().unwrap()["result"];
    assert_eq!(
        last["statusUpdate"]["status"]["state"],
        "TASK_STATE_CANCELED"
    );
    // The agent's later completion cannot overwrite the terminal state.
    gated.release(1);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let got = baton.call("GetTask", json!({"id": task_id})).await;
    assert_eq!(got.result()["status"]["state"], "TASK_STATE_CANCELED");
    baton.stop().await;
}

#[tokio::test]
async fn push_config_methods_round_trip() {
    let baton = baton().start().await;
    let task_id = baton.send_text(&message_id("m"), "x", json!({})).await["task"]["id"].clone();
    let created = baton
        .call(
            "CreateTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": "hook-1", "url": "https://example.com/hook", "token": "t0k"}),
        )
        .await;
    assert_eq!(created.result()["id"], "hook-1");
    assert_eq!(created.result()["taskId"], task_id);
    let got = baton
        .call(
            "GetTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": "hook-1"}),
        )
        .await;
    assert_eq!(got.result()["url"], "https://example.com/hook");
    let listed = baton
        .call(
            "ListTaskPushNotificationConfigs",
            json!({"taskId": task_id}),
        )
        .await;
    assert_eq!(listed.result()["configs"].as_array().unwrap().len(), 1);
    let deleted = baton
        .call(
            "DeleteTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": "hook-1"}),
        )
        .await;
    assert_eq!(deleted.result(), &json!({}));
    let missing = baton
        .call(
            "GetTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": "hook-1"}),
        )
        .await;
    assert_eq!(missing.code(), Some(-32001));
    baton.stop().await;
}

#[tokio::test]
async fn cards_are_published_with_validators() {
    let baton = baton().start().await;
    let response = baton
        .http
        .get(baton.url("/.well-known/agent-card.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let etag = response.headers()["etag"].to_str().unwrap().to_string();
    assert!(
        response.headers()["cache-control"]
            .to_str()
            .unwrap()
            .contains("max-age")
    );
    assert!(response.headers().contains_key("last-modified"));
    let card: Value = response.json().await.unwrap();
    assert_eq!(card["supportedInterfaces"][0]["url"], baton.url("/a2a"));
    assert_eq!(card["supportedInterfaces"][0]["protocolBinding"], "JSONRPC");
    assert_eq!(
        card["capabilities"]["extensions"][0]["uri"],
        "urn:baton:handoff:v1"
    );
    let skills: Vec<&str> = card["skills"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert!(
        skills.contains(&"echo/echo") && skills.contains(&"scenario/tck-scenarios"),
        "{skills:?}"
    );

    let revalidated = baton
        .http
        .get(baton.url("/.well-known/agent-card.json"))
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(revalidated.status(), 304);

    let agent = baton
        .http
        .get(baton.url("/agents/echo/.well-known/agent-card.json"))
        .send()
        .await
        .unwrap();
    let card: Value = agent.json().await.unwrap();
    assert_eq!(card["name"], "Echo");
    assert_eq!(
        card["supportedInterfaces"][0]["url"],
        baton.url("/agents/echo/a2a")
    );
    let missing = baton
        .http
        .get(baton.url("/agents/nope/.well-known/agent-card.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);

    // Without keys no caller is authenticated, so no extended card is
    // offered (spec §13.3): the cards do not declare one, and asking is -32004.
    assert!(card["capabilities"].get("extendedAgentCard").is_none());
    for path in ["/agents/echo/a2a", "/a2a"] {
        let extended = baton.call_at(path, "GetExtendedAgentCard", json!({})).await;
        assert_eq!(extended.code(), Some(-32004), "{path}: {}", extended.body);
    }
    baton.stop().await;
}

/// With keys, the cards offer an extended card, served to a caller with a
/// key; without one the call is 401.
#[tokio::test]
async fn the_extended_card_is_served_to_authenticated_callers() {
    let baton = baton().api_keys("acme=KEY1").start().await;
    let card = baton
        .http
        .get(baton.url("/agents/echo/.well-known/agent-card.json"))
        .send()
        .await
        .unwrap();
    let card: Value = card.json().await.unwrap();
    assert_eq!(card["capabilities"]["extendedAgentCard"], true);
    for (path, name) in [("/agents/echo/a2a", "Echo"), ("/a2a", "Baton")] {
        let extended = baton
            .call_as(path, "KEY1", "GetExtendedAgentCard", json!({}))
            .await;
        assert_eq!(extended.result()["name"], name, "{path}");
        let anonymous = baton.call_at(path, "GetExtendedAgentCard", json!({})).await;
        assert_eq!(anonymous.status, 401, "{path}: {}", anonymous.body);
    }
    baton.stop().await;
}

#[tokio::test]
async fn endpoints_answer_with_a_trailing_slash_and_route_by_tenant() {
    let baton = baton().start().await;
    for path in ["/a2a/", "/agents/scenario/a2a/", "/agents/scenario/a2a"] {
        let reply = baton
            .call_at(
                path,
                "SendMessage",
                json!({"message": user_message(&message_id("tck-complete-task"), "x")}),
            )
            .await;
        assert!(reply.result()["task"].is_object(), "{path}: {}", reply.body);
    }
    // tenant routes /a2a calls to an agent: scenario answers tck-message-response with a message.
    let routed = baton
        .call(
            "SendMessage",
            json!({"tenant": "scenario", "message": user_message(&message_id("tck-message-response"), "x")}),
        )
        .await;
    assert!(routed.result()["message"].is_object());
    // Without a tenant, the default agent (echo) answers.
    let default = baton
        .call(
            "SendMessage",
            json!({"message": user_message(&message_id("tck-message-response"), "x")}),
        )
        .await;
    assert_eq!(default.result()["task"]["artifacts"][0]["name"], "echo");

    let health = baton.http.get(baton.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let ready = baton.http.get(baton.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    baton.stop().await;
}

#[tokio::test]
async fn echo_tailors_its_output_to_accepted_output_modes() {
    let baton = baton().start().await;
    let result = baton
        .send_text(
            &message_id("m"),
            "hello",
            json!({"configuration": {"acceptedOutputModes": ["application/json"]}}),
        )
        .await;
    let part = &result["task"]["artifacts"][0]["parts"][0];
    assert_eq!(part["data"], json!({"text": "hello"}));
    assert_eq!(part["mediaType"], "application/json");
    baton.stop().await;
}

#[tokio::test]
async fn an_agent_reporting_past_the_size_limit_is_stopped_and_its_task_fails() {
    const LIMIT: usize = 1024 * 1024;
    let chatty = ChattyAgent::with_note_bytes("chatty", 100 * 1024);
    let limit = |settings: &mut GatewaySettings| settings.max_task_bytes = LIMIT;
    let task = agent_past_a_limit_is_stopped(chatty, limit, "TASK_SIZE_EXCEEDED").await;
    let status_part = &task["status"]["message"]["parts"][0]["data"];
    assert_eq!(status_part["detail"]["limitBytes"], LIMIT, "{status_part}");
    // What was kept is the artifacts that fit.
    let kept = task["artifacts"].as_array().map_or(0, Vec::len);
    assert!((5..=10).contains(&kept), "{kept} artifacts kept");
    assert!(task.to_string().len() < LIMIT);
}

#[tokio::test]
async fn a_message_past_the_size_limit_is_refused_and_the_task_still_waits_for_an_answer() {
    let baton = baton()
        .default_agent("scenario")
        .tune(|settings| settings.max_task_bytes = 1024 * 1024)
        .start()
        .await;
    let opened = baton
        .send_text(&message_id("tck-input-required"), "ask", json!({}))
        .await;
    let task_id = opened["task"]["id"].as_str().unwrap().to_string();
    let long = "x".repeat(400 * 1024);
    // Two long answers fit (each is asked again); the third would not.
    for turn in 0..3 {
        let answer = user_message_on(&task_id, &message_id("tck-input-required"), &long);
        let reply = baton.call("SendMessage", json!({"message": answer})).await;
        if turn < 2 {
            let state = &reply.result()["task"]["status"]["state"];
            assert_eq!(state, "TASK_STATE_INPUT_REQUIRED", "turn {turn}");
            continue;
        }
        assert_eq!(reply.code(), Some(-32602), "{}", reply.body);
        let violation = &reply.body["error"]["data"][0]["fieldViolations"][0];
        assert_eq!(violation["field"], "message", "{violation}");
        let description = violation["description"].as_str().unwrap();
        assert!(description.contains("1048576"), "{description}");
    }
    // Nothing of the refused message was kept, and the task still takes
    // an answer that fits.
    let got = baton.call("GetTask", json!({"id": task_id})).await;
    let history = got.result()["history"].as_array().unwrap();
    let long_messages = history
        .iter()
        .filter(|m| m["parts"][0]["text"] == long.as_str())
        .count();
    assert_eq!(long_messages, 2);
    let answer = user_message_on(&task_id, &message_id("tck-complete-task"), "short");
    let reply = baton.call("SendMessage", json!({"message": answer})).await;
    let state = &reply.result()["task"]["status"]["state"];
    assert_eq!(state, "TASK_STATE_COMPLETED", "{}", reply.body);
    baton.stop().await;
}

#[tokio::test]
async fn an_agent_reporting_past_the_event_limit_is_stopped_and_its_task_fails() {
    let chatty = ChattyAgent::new("chatty");
    let limit = |settings: &mut GatewaySettings| settings.max_task_events = 20;
    let task = agent_past_a_limit_is_stopped(chatty, limit, "EVENT_LIMIT_EXCEEDED").await;
    let status_part = &task["status"]["message"]["parts"][0]["data"];
    assert_eq!(status_part["detail"]["limit"], 20, "{status_part}");
    // What was kept stays within the limit.
    let kept = task["artifacts"].as_array().map_or(0, Vec::len);
    assert!((1..20).contains(&kept), "{kept} artifacts kept");
}

/// An agent whose ids come in the report that passes the size limit: the
/// ids are still written, so the cancel that stops it names its own task;
/// the report's COMPLETED is not counted as a transition, the FAILED is.
#[tokio::test]
async fn ids_in_a_report_past_the_size_limit_reach_the_agent_s_cancel() {
    let agent = BindsInLargeReport::new("late", 1536 * 1024);
    let (baton, _) = large_report_fails_the_task(agent).await;
    assert_eq!(
        transition_counts(&baton.metrics().await),
        [r#"{from="TASK_STATE_WORKING",to="TASK_STATE_FAILED"} 1"#]
    );
    baton.stop().await;
}

/// An agent whose first report is past the size limit: the task is
/// created with the caller's message alone, with the agent's ids, and
/// fails; the agent's cancel names its own task.
#[tokio::test]
async fn a_first_report_past_the_size_limit_fails_the_new_task() {
    let agent = BindsInLargeReport::new("eager", 1536 * 1024).at_once();
    let (baton, task) = large_report_fails_the_task(agent).await;
    assert!(task.get("artifacts").is_none(), "{task}");
    assert_eq!(task["history"][0]["parts"][0]["text"], "work");
    // Its events: the snapshot, then the FAILED.
    let record = baton.ledger.get(task["id"].as_str().unwrap()).unwrap();
    let record = record.unwrap();
    assert_eq!(record.last_seq, 2);
    assert_eq!(record.hops.len(), 1);
    assert_eq!(
        record.hops[0].state,
        Some(baton::protocol::TaskState::Failed)
    );
    assert_eq!(
        transition_counts(&baton.metrics().await),
        [r#"{from="TASK_STATE_SUBMITTED",to="TASK_STATE_FAILED"} 1"#]
    );
    baton.stop().await;
}

/// `agent`'s large report fails its task under a 1 MiB limit: its ids are
/// kept, and its cancel names them. Returns Baton, still running, and the
/// task.
async fn large_report_fails_the_task(agent: BindsInLargeReport) -> (TestBaton, Value) {
    let (ids, cancels) = (agent.ids.clone(), agent.cancels.clone());
    let baton = baton()
        .agent("large", agent)
        .tune(|settings| settings.max_task_bytes = 1024 * 1024)
        .start()
        .await;
    let task = baton.send_fails_with("large", "TASK_SIZE_EXCEEDED").await;
    let record = baton
        .ledger
        .get(task["id"].as_str().unwrap())
        .unwrap()
        .unwrap();
    assert_eq!(record.upstream.as_ref(), Some(&ids));
    assert_eq!(*cancels.lock().unwrap(), vec![Some(ids)]);
    (baton, task)
}

/// `chatty` reports until `limit` fails its task with `expected`; what was
/// kept reads back the same, and the agent reports nothing more. Returns
/// the task.
async fn agent_past_a_limit_is_stopped(
    chatty: ChattyAgent,
    limit: fn(&mut GatewaySettings),
    expected: &str,
) -> Value {
    let baton = baton()
        .agent("chatty", chatty.clone())
        .tune(limit)
        .start()
        .await;
    let task = baton.send_fails_with("chatty", expected).await;
    let got = baton.call("GetTask", json!({"id": task["id"]})).await;
    assert_eq!(got.result()["status"], task["status"]);
    assert_eq!(got.result()["artifacts"], task["artifacts"]);
    // The agent was stopped: it reports nothing more.
    let stopped_at = chatty.reported();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(chatty.reported(), stopped_at);
    baton.stop().await;
    task
}

/// A task asking for input with the most events it may hold can take no
/// answer (its agent's first report would pass the limit): as its reply
/// goes out, it fails with `EVENT_LIMIT_EXCEEDED` instead of waiting for
/// its deadline, and a later answer is refused as a message to an ended
/// task is, with nothing of it kept.
#[tokio::test]
async fn a_task_asking_for_input_at_its_event_limit_fails_at_once() {
    let baton = baton()
        .default_agent("scenario")
        .tune(|settings| settings.max_task_events = 4)
        .start()
        .await;
    let asking = message_id("tck-input-required");
    let opened = baton.send_text(&asking, "ask", json!({})).await;
    let task_id = opened["task"]["id"].as_str().unwrap().to_string();
    assert_eq!(
        opened["task"]["status"]["state"],
        "TASK_STATE_INPUT_REQUIRED"
    );
    // Each answer is asked again: WORKING, then INPUT_REQUIRED, the fourth event.
    let answer = user_message_on(&task_id, &asking, "first");
    let reply = baton.call("SendMessage", json!({"message": answer})).await;
    // The reply shows the task waiting, or already failed.
    let state = reply.result()["task"]["status"]["state"].clone();
    let shown = ["TASK_STATE_INPUT_REQUIRED", "TASK_STATE_FAILED"];
    assert!(shown.contains(&state.as_str().unwrap()), "{}", reply.body);
    let failed = || {
        let record = baton.ledger.get(&task_id).unwrap().unwrap();
        record.task.status.state == baton::protocol::TaskState::Failed
    };
    wait_until("the task at its limit never failed", failed).await;
    let task = baton.call("GetTask", json!({"id": task_id})).await;
    let task = &task.result();
    let reason = &task["status"]["message"]["parts"][0]["data"];
    assert_eq!(reason["reason"], "EVENT_LIMIT_EXCEEDED", "{task}");
    assert_eq!(reason["detail"]["limit"], 4, "{task}");
    let before = baton.ledger.get(&task_id).unwrap().unwrap();

    let answer = user_message_on(&task_id, &asking, "second");
    let reply = baton.call("SendMessage", json!({"message": answer})).await;
    assert_eq!(reply.code(), Some(-32004), "{}", reply.body);
    let after = baton.ledger.get(&task_id).unwrap().unwrap();
    assert_eq!(after, before);
    baton.stop().await;
}

/// A stream Baton ends as it stops, its task still working, ends with an
/// error saying so: a client reading to the end would otherwise take the
/// close for the task's end.
#[tokio::test]
async fn a_stream_cut_by_a_stop_ends_with_an_error_not_as_if_the_task_had() {
    let gated = GatedAgent::new();
    let baton = baton().agent("gated", gated.clone()).start().await;
    let params = json!({"tenant": "gated", "message": user_message(&message_id("m"), "work")});
    let response = baton
        .open_stream("/a2a", "SendStreamingMessage", params)
        .await;
    let reading = tokio::spawn(read_sse(response, 10));
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    baton.stop().await;
    let read = tokio::time::timeout(WAIT, reading)
        .await
        .expect("the stream ends")
        .unwrap();
    assert!(read.closed);
    let last = read.events.last().expect("events");
    assert_eq!(last["error"]["code"], -32603, "{:?}", read.events);
    assert_eq!(last["error"]["data"][0]["reason"], "GATEWAY_STOPPING");
    let task_id = &read.events[0]["result"]["task"]["id"];
    assert_eq!(last["error"]["data"][0]["metadata"]["taskId"], *task_id);
    assert!(
        read.events[..read.events.len() - 1]
            .iter()
            .all(|event| event["result"].is_object()),
        "{:?}",
        read.events
    );
    gated.release(1);
}
