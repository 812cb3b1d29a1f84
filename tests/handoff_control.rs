//! Handoff control over real HTTP (DESIGN.md §3.1, §3.4): trace ids, hops,
//! chains and deadlines carried to the agent, and the policy refusals.

mod common;

use common::agents::{GatedAgent, UnresponsiveAgent, card};
use common::*;
use serde_json::{Value, json};

/// Registers `agent` of `upstream` at `gateway` under `id`.
async fn register(gateway: &TestBaton, upstream: &TestBaton, agent: &str, id: &str) {
    let card = upstream.published_card(agent).await;
    gateway
        .registry("RegisterAgent", json!({"id": id, "card": card}))
        .await
        .result();
}

#[tokio::test]
async fn the_trace_and_hop_reach_the_agent_and_are_mirrored_on_the_task() {
    let upstream = baton().start().await;
    let gateway = baton().start().await;
    register(&gateway, &upstream, "scenario", "remote").await;

    let trace = "0af7651916cd43dd8448eb211c80319c";
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {
        "message": user_message(&message_id("tck-complete-task"), "hi")}});
    let reply = gateway
        .post_raw(
            "/agents/remote/a2a",
            body.to_string(),
            &[
                ("content-type", "application/json"),
                ("a2a-version", "1.0"),
                ("traceparent", &format!("00-{trace}-b7ad6b7169203331-01")),
            ],
        )
        .await;
    let task = &reply.result()["task"];
    let mirrored = &task["metadata"]["urn:baton:handoff:v1"];
    assert_eq!(mirrored["traceId"], trace);
    assert_eq!(mirrored["hops"], 1);
    assert_eq!(mirrored["chain"], json!(["remote"]));
    assert_eq!(mirrored["maxHops"], 5);
    assert!(
        mirrored["deadline"]
            .as_str()
            .is_some_and(|d| d.ends_with('Z'))
    );

    // The upstream, itself a Baton, received hop 1 with chain [remote] and
    // honoured it: its own delivery is hop 2, in the same trace.
    let listed = upstream
        .call_at("/agents/scenario/a2a", "ListTasks", json!({}))
        .await;
    let upstream_task = &listed.result()["tasks"][0];
    let upstream_control = &upstream_task["metadata"]["urn:baton:handoff:v1"];
    assert_eq!(upstream_control["traceId"], trace);
    assert_eq!(upstream_control["hops"], 2);
    assert_eq!(upstream_control["chain"], json!(["remote", "scenario"]));
    gateway.stop().await;
    upstream.stop().await;
}

#[tokio::test]
async fn the_hop_limit_and_cycles_are_refused_before_forwarding() {
    let gateway = baton().start().await;
    let control = |hops: u32, chain: Value| {
        let mut message = user_message(&message_id("m"), "x");
        message["metadata"] = json!({"urn:baton:handoff:v1": {"hops": hops, "chain": chain}});
        json!({"message": message})
    };
    let refused = gateway
        .call_at(
            "/agents/echo/a2a",
            "SendMessage",
            control(5, json!(["a", "b", "c", "d", "e"])),
        )
        .await;
    let task = &refused.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED");
    assert_eq!(reason(task), "HOP_LIMIT_EXCEEDED");
    assert!(task.get("artifacts").is_none(), "the agent never saw it");

    // A caller may shorten the limit.
    let mut message = user_message(&message_id("m"), "x");
    message["metadata"] = json!({"urn:baton:handoff:v1": {"hops": 2, "maxHops": 2}});
    let shortened = gateway
        .call_at(
            "/agents/echo/a2a",
            "SendMessage",
            json!({"message": message}),
        )
        .await;
    assert_eq!(reason(&shortened.result()["task"]), "HOP_LIMIT_EXCEEDED");

    // Headers count as well: Baton-Hops from another gateway.
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": user_message(&message_id("m"), "x")}});
    let by_header = gateway
        .post_raw(
            "/agents/echo/a2a",
            body.to_string(),
            &[
                ("content-type", "application/json"),
                ("a2a-version", "1.0"),
                ("baton-hops", "7"),
            ],
        )
        .await;
    assert_eq!(reason(&by_header.result()["task"]), "HOP_LIMIT_EXCEEDED");

    let cycle = gateway
        .call_at(
            "/agents/echo/a2a",
            "SendMessage",
            control(2, json!(["echo", "scenario"])),
        )
        .await;
    let task = &cycle.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED");
    assert_eq!(reason(task), "HANDOFF_CYCLE");
    assert_eq!(
        task["status"]["message"]["parts"][0]["data"]["detail"]["chain"],
        json!(["echo", "scenario"])
    );

    // Under the limit and not in the chain: delivered.
    let fine = gateway
        .call_at(
            "/agents/echo/a2a",
            "SendMessage",
            control(1, json!(["scenario"])),
        )
        .await;
    let task = &fine.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(
        task["metadata"]["urn:baton:handoff:v1"]["chain"],
        json!(["scenario", "echo"])
    );
    gateway.stop().await;
}

#[tokio::test]
async fn a_passed_deadline_fails_the_task_and_cancels_it_downstream_at_once() {
    let gated = GatedAgent::new();
    let upstream = baton().agent("gated", gated.clone()).start().await;
    let gateway = baton().start().await;
    register(&gateway, &upstream, "gated", "slow").await;

    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(800);
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {
        "message": user_message(&message_id("m"), "take your time"),
        "configuration": {"returnImmediately": true}}});
    let reply = gateway
        .post_raw(
            "/agents/slow/a2a",
            body.to_string(),
            &deadline_headers(&baton::protocol::wire::format_timestamp(&deadline)),
        )
        .await;
    let task_id = reply.result()["task"]["id"].as_str().unwrap().to_string();

    let started = std::time::Instant::now();
    let failed = loop {
        let got = gateway.call("GetTask", json!({"id": task_id})).await;
        let task = got.result().clone();
        if task["status"]["state"] == "TASK_STATE_FAILED" {
            break task;
        }
        assert!(
            started.elapsed() < WAIT,
            "still {}",
            task["status"]["state"]
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(reason(&failed), "DEADLINE_EXCEEDED");
    let failed_at = chrono::Utc::now();
    assert!(failed_at - deadline < chrono::Duration::seconds(1));

    // Downstream the work stopped within a second of the deadline: the
    // upstream Baton got the deadline with the message and enforced it too
    // (or took the gateway's CancelTask, whichever came first).
    let upstream_tasks = upstream
        .call_at("/agents/gated/a2a", "ListTasks", json!({}))
        .await;
    let upstream_task = &upstream_tasks.result()["tasks"][0];
    let state = upstream_task["status"]["state"].as_str().unwrap();
    assert!(
        state == "TASK_STATE_CANCELED"
            || (state == "TASK_STATE_FAILED" && reason(upstream_task) == "DEADLINE_EXCEEDED"),
        "{upstream_task}"
    );
    let canceled_at = chrono::DateTime::parse_from_rfc3339(
        upstream_task["status"]["timestamp"].as_str().unwrap(),
    )
    .unwrap();
    assert!(canceled_at.with_timezone(&chrono::Utc) - deadline < chrono::Duration::seconds(1));
    gateway.stop().await;
    upstream.stop().await;
}

/// A deadline that passed before the call arrived: the agent is never
/// called, and the caller learns why.
#[tokio::test]
async fn a_deadline_passed_before_the_call_never_reaches_the_agent() {
    let gateway = baton().start().await;
    let send = |return_immediately: bool| {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {
            "message": user_message(&message_id("m"), "too late"),
            "configuration": {"returnImmediately": return_immediately}}});
        let headers = deadline_headers("2000-01-01T00:00:00.000Z");
        let gateway = &gateway;
        async move {
            gateway
                .post_raw("/agents/echo/a2a", body.to_string(), &headers)
                .await
        }
    };
    // No task is made, blocking or not; the error says the deadline passed.
    for return_immediately in [false, true] {
        let refused = send(return_immediately).await;
        assert_eq!(refused.code(), Some(-32603), "{}", refused.body);
        assert_eq!(
            refused.body["error"]["data"][0]["reason"],
            "UPSTREAM_TIMEOUT"
        );
        assert!(
            refused.body["error"]["message"]
                .to_string()
                .contains("deadline passed"),
            "{}",
            refused.body
        );
    }
    let listed = gateway.call("ListTasks", json!({})).await;
    assert_eq!(listed.result()["tasks"], json!([]), "{}", listed.body);
    gateway.stop().await;
}

/// The payload the tests below hand off, to `target`, under one fixed id.
fn payload(target: Value) -> Value {
    handoff_payload("triage", target, json!({"handoffId": "hf_1"}))
}

/// A handoff message whose payload part follows a text part.
fn after_text(payload: Value) -> Value {
    let mut message = handoff_message(payload);
    let parts = message["parts"].as_array_mut().unwrap();
    parts.insert(0, json!({"text": "please take over"}));
    message
}

#[tokio::test]
async fn direct_handoffs_go_to_the_payload_target_or_are_rejected_with_the_reason() {
    let gateway = baton().start().await;

    // `to` picks the agent, even on /a2a where the default would be echo.
    let reply = gateway
        .call(
            "SendMessage",
            json!({"message": handoff_message(payload(json!({"to": "scenario"})))}),
        )
        .await;
    let task = &reply.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(
        task["status"]["message"]["parts"][0]["text"], "Hello from TCK",
        "the scenario agent answered"
    );
    assert_eq!(
        task["metadata"]["urn:baton:handoff:v1"]["handoffId"],
        "hf_1"
    );

    // `toSkill` picks an agent declaring the skill.
    let reply = gateway
        .call(
            "SendMessage",
            json!({"message": handoff_message(payload(json!({"toSkill": "echo"})))}),
        )
        .await;
    assert_eq!(reply.result()["task"]["artifacts"][0]["name"], "echo");

    // Unknown targets, the payload found behind a text part.
    for target in [json!({"to": "payroll"}), json!({"toSkill": "payroll"})] {
        let message = after_text(payload(target.clone()));
        let reply = gateway
            .call("SendMessage", json!({"message": message}))
            .await;
        let task = &reply.result()["task"];
        assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED", "{target}");
        assert_eq!(reason(task), "TARGET_NOT_FOUND", "{target}");
    }

    // A payload that fails the schema names every violation.
    let invalid = json!({"handoffId": "hf_2", "from": "triage", "to": "echo", "toSkill": "echo", "reason": "boredom", "goal": ""});
    let reply = gateway
        .call("SendMessage", json!({"message": handoff_message(invalid)}))
        .await;
    let task = &reply.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED");
    assert_eq!(reason(task), "SCHEMA_INVALID");
    let violations = task["status"]["message"]["parts"][0]["data"]["detail"]["violations"]
        .as_array()
        .unwrap();
    let pointers: Vec<&str> = violations
        .iter()
        .map(|v| v["pointer"].as_str().unwrap())
        .collect();
    for expected in ["/goal", "/reason", "/summary", "/toSkill"] {
        assert!(
            pointers.contains(&expected),
            "{expected} missing from {pointers:?}"
        );
    }

    // On an agent's own path, `to` must be that agent.
    let reply = gateway
        .call_at(
            "/agents/echo/a2a",
            "SendMessage",
            json!({"message": handoff_message(payload(json!({"to": "scenario"})))}),
        )
        .await;
    assert_eq!(reply.code(), Some(-32602));
    let reply = gateway
        .call_at(
            "/agents/echo/a2a",
            "SendMessage",
            json!({"message": handoff_message(payload(json!({"to": "echo"})))}),
        )
        .await;
    assert_eq!(
        reply.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    gateway.stop().await;
}

#[tokio::test]
async fn routing_rules_choose_the_agent_of_calls_that_name_none() {
    let gateway = baton()
        .routing(
            r#"
            [[route]]
            when = { text = "(?i)refund" }
            to = { agent = "scenario" }

            [[route]]
            when = { tenant = "acme" }
            to = { agent = "scenario" }
            "#,
        )
        .start()
        .await;
    let routed = gateway
        .call("SendMessage", json!({"message": user_message(&message_id("tck-message-response"), "I want a REFUND")}))
        .await;
    // A routed call is a handoff (DESIGN.md §3.3): the agent's message
    // completes a task, as its artifact `response`.
    let task = &routed.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(task["artifacts"][0]["name"], "response");
    assert_eq!(
        task["artifacts"][0]["parts"][0]["text"],
        "Direct message response"
    );
    // No rule matches: the default agent (echo).
    let default = gateway
        .call(
            "SendMessage",
            json!({"message": user_message(&message_id("tck-message-response"), "hello")}),
        )
        .await;
    assert_eq!(default.result()["task"]["artifacts"][0]["name"], "echo");
    // A tenant wins over the rules.
    let pinned = gateway
        .call(
            "SendMessage",
            json!({"tenant": "echo", "message": user_message(&message_id("m"), "refund please")}),
        )
        .await;
    assert_eq!(pinned.result()["task"]["artifacts"][0]["name"], "echo");
    // A tenant that names no agent is a label the rules may match; the
    // label also reaches the task on the gateway's endpoint.
    let labeled = gateway
        .call(
            "SendMessage",
            json!({"tenant": "acme", "message": user_message(&message_id("tck-message-response"), "hello")}),
        )
        .await;
    assert_eq!(
        labeled.result()["task"]["artifacts"][0]["parts"][0]["text"],
        "Direct message response",
        "{}",
        labeled.body
    );
    let task_id = default.result()["task"]["id"].clone();
    let read = gateway
        .call("GetTask", json!({"tenant": "acme", "id": task_id}))
        .await;
    assert_eq!(read.result()["id"], task_id, "{}", read.body);
    // A label is part of what an idempotent send is compared by.
    let keyed = |tenant: Option<&str>| {
        let mut params = json!({"message": user_message("same-message", "hello")});
        if let Some(tenant) = tenant {
            params["tenant"] = json!(tenant);
        }
        let body = json!({"jsonrpc": "2.0", "id": 9, "method": "SendMessage", "params": params});
        let mut headers = STANDARD_HEADERS.to_vec();
        headers.push(("idempotency-key", "label-key"));
        let gateway = &gateway;
        async move { gateway.post_raw("/a2a", body.to_string(), &headers).await }
    };
    assert!(keyed(Some("acme")).await.code().is_none());
    assert_eq!(
        keyed(None).await.code(),
        Some(-32602),
        "another address, same key"
    );
    // No agency may register an agent under a label, and take its calls.
    let card = gateway.published_card("echo").await;
    let taken = gateway
        .registry("RegisterAgent", json!({"id": "acme", "card": card}))
        .await;
    assert_eq!(taken.code(), Some(-32602), "{}", taken.body);
    assert!(
        taken.body.to_string().contains("tenant label"),
        "{}",
        taken.body
    );
    // A label no rule matches is still refused.
    let unknown = gateway
        .call(
            "SendMessage",
            json!({"tenant": "acne", "message": user_message(&message_id("m"), "hello")}),
        )
        .await;
    assert_eq!(unknown.code(), Some(-32602), "{}", unknown.body);
    gateway.stop().await;
}

/// Work sent to `agent` without waiting for it, as a child of `parent` if
/// given; the task's id.
async fn work_at(gateway: &TestBaton, agent: &str, parent: Option<&str>) -> String {
    let mut message = user_message(&message_id("m"), "work");
    if let Some(parent) = parent {
        message["metadata"] = json!({"urn:baton:handoff:v1": {"parentTaskId": parent}});
    }
    let params = json!({"message": message, "configuration": {"returnImmediately": true}});
    let path = format!("/agents/{agent}/a2a");
    let reply = gateway.call_at(&path, "SendMessage", params).await;
    reply.result()["task"]["id"].as_str().unwrap().to_string()
}

/// The state of task `id`, as GetTask answers.
async fn state_of(gateway: &TestBaton, id: &str) -> Value {
    let got = gateway.call("GetTask", json!({"id": id})).await;
    got.result()["status"]["state"].clone()
}

#[tokio::test]
async fn canceling_a_task_cancels_its_handoff_graph() {
    let gated = GatedAgent::new();
    // Three agents: handing back to an agent already in the chain would be a cycle.
    let gateway = baton()
        .agent("gated", gated.clone())
        .agent("gated-2", gated.clone())
        .agent("gated-3", gated.clone())
        .start()
        .await;
    let parent = work_at(&gateway, "gated", None).await;
    let child = work_at(&gateway, "gated-2", Some(&parent)).await;
    let grandchild = work_at(&gateway, "gated-3", Some(&child)).await;
    let unrelated = work_at(&gateway, "gated", None).await;

    let canceled = gateway.call("CancelTask", json!({"id": parent})).await;
    assert_eq!(canceled.result()["status"]["state"], "TASK_STATE_CANCELED");
    for task in [&child, &grandchild] {
        assert_eq!(
            state_of(&gateway, task).await,
            "TASK_STATE_CANCELED",
            "{task}"
        );
    }
    assert_eq!(state_of(&gateway, &unrelated).await, "TASK_STATE_WORKING");
    gated.release(10);
    gateway.stop().await;
}

/// A cancel's cascade records every child canceled without waiting for
/// their agents, one of which never answers a CancelTask; a child made
/// under the parent once it is canceled is canceled too.
#[tokio::test]
async fn a_cancel_cascade_waits_for_no_agent_and_reaches_children_made_after_it() {
    let gated = GatedAgent::new();
    let gateway = baton()
        .agent("gated", gated.clone())
        .agent("gated-2", gated.clone())
        .agent("unresponsive", UnresponsiveAgent(card("unresponsive")))
        .start()
        .await;
    let parent = work_at(&gateway, "gated", None).await;
    let mut children = Vec::new();
    for agent in ["unresponsive", "gated-2"] {
        children.push(work_at(&gateway, agent, Some(&parent)).await);
    }

    let canceled = gateway.call("CancelTask", json!({"id": parent})).await;
    assert_eq!(
        canceled.result()["status"]["state"],
        "TASK_STATE_CANCELED",
        "{}",
        canceled.body
    );
    for task in &children {
        assert_eq!(
            state_of(&gateway, task).await,
            "TASK_STATE_CANCELED",
            "{task}"
        );
    }

    let late = work_at(&gateway, "gated-2", Some(&parent)).await;
    let mut last = Value::Null;
    for _ in 0..100 {
        last = state_of(&gateway, &late).await;
        if last == "TASK_STATE_CANCELED" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(last, "TASK_STATE_CANCELED", "the late child");

    // A handoff naming the canceled parent, too; it stays canceled.
    let mut message = handoff_message(payload(json!({"to": "gated-2"})));
    message["metadata"] = json!({"urn:baton:handoff:v1": {"parentTaskId": parent}});
    let handed = gateway
        .call(
            "SendMessage",
            json!({"message": message, "configuration": {"returnImmediately": true}}),
        )
        .await;
    let handed = handed.result()["task"]["id"].as_str().unwrap().to_string();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(
        state_of(&gateway, &handed).await,
        "TASK_STATE_CANCELED",
        "the late handoff"
    );
    gated.release(10);
    gateway.stop().await;
}

/// A parent canceled in the ledger whose cascade never ran (a crash right
/// after the parent's write): a retried CancelTask answers -32002 and
/// finishes the cascade.
#[tokio::test]
async fn a_retried_cancel_finishes_a_cascade_cut_short() {
    let gated = GatedAgent::new();
    let gateway = baton()
        .agent("gated", gated.clone())
        .agent("gated-2", gated.clone())
        .start()
        .await;
    let parent = work_at(&gateway, "gated", None).await;
    let child = work_at(&gateway, "gated-2", Some(&parent)).await;
    gateway
        .ledger
        .update(&parent, |record| {
            let task = &record.task;
            let canceled = baton::protocol::TaskStatusUpdateEvent {
                task_id: task.id.clone(),
                context_id: task.context_id.clone(),
                status: baton::protocol::TaskStatus::now(
                    baton::protocol::TaskState::Canceled,
                    None,
                ),
                metadata: None,
            };
            Ok::<_, baton::store::LedgerError>(vec![baton::protocol::StreamResponse::StatusUpdate(
                canceled,
            )])
        })
        .await
        .unwrap();
    assert_eq!(state_of(&gateway, &child).await, "TASK_STATE_WORKING");

    let retried = gateway.call("CancelTask", json!({"id": parent})).await;
    assert_eq!(retried.code(), Some(-32002), "{}", retried.body);
    assert_eq!(state_of(&gateway, &child).await, "TASK_STATE_CANCELED");
    gated.release(10);
    gateway.stop().await;
}

/// A schema whose `$ref`s double at each level: a few kilobytes that a
/// validation would take hours to walk.
fn doubling_schema(levels: usize) -> Value {
    let mut defs = serde_json::Map::new();
    defs.insert("d0".into(), json!({"type": "integer"}));
    for level in 1..=levels {
        let before = format!("#/$defs/d{}", level - 1);
        defs.insert(
            format!("d{level}"),
            json!({"anyOf": [{"$ref": before}, {"$ref": before}]}),
        );
    }
    json!({"$defs": defs, "$ref": format!("#/$defs/d{levels}")})
}

/// A result schema whose check would cost too much is refused where it is
/// given (a handoff's returnSchema, a skill's output schema), not found
/// out under the ledger's lock once the result arrives.
#[tokio::test]
async fn a_result_schema_too_costly_to_check_is_refused_where_it_is_given() {
    let gateway = baton().start().await;
    let mut costly = payload(json!({"to": "echo"}));
    costly["returnSchema"] = doubling_schema(40);
    let reply = gateway
        .call("SendMessage", json!({"message": after_text(costly)}))
        .await;
    let task = &reply.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED", "{task}");
    assert_eq!(reason(task), "SCHEMA_INVALID");
    let violation = &task["status"]["message"]["parts"][0]["data"]["detail"]["violations"][0];
    assert_eq!(violation["pointer"], "/returnSchema", "{violation}");
    assert!(
        violation["message"]
            .as_str()
            .unwrap()
            .contains("schema nodes"),
        "{violation}"
    );

    let card = gateway.published_card("echo").await;
    let registered = gateway
        .registry(
            "RegisterAgent",
            json!({"id": "typed-echo", "card": card, "skillOutputSchemas": {"echo": doubling_schema(40)}}),
        )
        .await;
    assert_eq!(registered.code(), Some(-32602), "{}", registered.body);
    assert!(
        registered
            .body
            .to_string()
            .contains("/skillOutputSchemas/echo"),
        "{}",
        registered.body
    );
    gateway.stop().await;
}

#[tokio::test]
async fn typed_artifacts_are_checked_against_the_return_schema() {
    let gateway = baton().start().await;
    // echo returns the parts it gets, so its artifact holds the payload itself.
    let typed = |schema: Value| {
        let mut payload = payload(json!({"to": "echo"}));
        payload["returnSchema"] = schema;
        // Violations must name the data part by its index.
        json!({"message": after_text(payload)})
    };
    let ok = gateway
        .call(
            "SendMessage",
            typed(json!({"type": "object", "required": ["handoffId", "goal"]})),
        )
        .await;
    assert_eq!(
        ok.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );

    let wrong = gateway
        .call(
            "SendMessage",
            typed(json!({"type": "object", "required": ["refundId"], "properties": {"goal": {"type": "integer"}}})),
        )
        .await;
    let task = &wrong.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED");
    assert_eq!(reason(task), "OUTPUT_SCHEMA_INVALID");
    let violations = task["status"]["message"]["parts"][0]["data"]["detail"]["violations"]
        .as_array()
        .unwrap();
    let pointers: Vec<&str> = violations
        .iter()
        .map(|v| v["pointer"].as_str().unwrap())
        .collect();
    assert!(
        pointers.contains(&"/artifacts/0/parts/1/data"),
        "{pointers:?}"
    );
    assert!(
        pointers.contains(&"/artifacts/0/parts/1/data/goal"),
        "{pointers:?}"
    );
    assert!(
        task["artifacts"][0]["parts"][1]["data"].is_object(),
        "the artifacts are kept for inspection"
    );
    gateway.stop().await;
}

/// Only an agent's "not cancelable" (-32002) keeps a task from being
/// canceled; any other refusal, such as -32001 from an agent that forgot
/// its task, leaves the cancel to the gateway, which owns the task.
#[tokio::test]
async fn only_an_agents_not_cancelable_answer_keeps_a_task_from_canceling() {
    for (code, canceled) in [(-32001, true), (-32603, true), (-32002, false)] {
        let card = common::agents::card("refusing");
        let agent = common::agents::RefusingCancelAgent { card, code };
        let gateway = baton().agent("refusing", agent).start().await;
        let reply = gateway
            .call_at(
                "/agents/refusing/a2a",
                "SendMessage",
                json!({"message": user_message(&message_id("c"), "work"),
                       "configuration": {"returnImmediately": true}}),
            )
            .await;
        let task_id = reply.result()["task"]["id"].as_str().unwrap().to_string();
        gateway
            .wait_for_state("/a2a", &task_id, "TASK_STATE_WORKING")
            .await;
        let cancel = gateway.call("CancelTask", json!({"id": task_id})).await;
        if canceled {
            assert_eq!(
                cancel.result()["status"]["state"],
                "TASK_STATE_CANCELED",
                "{code}: {}",
                cancel.body
            );
        } else {
            assert_eq!(cancel.body["error"]["code"], code, "{}", cancel.body);
            // The caller's error names the caller's task, not the agent's.
            let info = &cancel.body["error"]["data"][0];
            assert_eq!(info["reason"], "TASK_NOT_CANCELABLE", "{}", cancel.body);
            assert_eq!(info["domain"], "a2a-protocol.org");
            assert_eq!(info["metadata"]["taskId"], task_id.as_str());
            assert_eq!(info["metadata"]["state"], "TASK_STATE_WORKING");
            let task = gateway.call("GetTask", json!({"id": task_id})).await;
            assert_eq!(task.result()["status"]["state"], "TASK_STATE_WORKING");
        }
        gateway.stop().await;
    }
}

#[tokio::test]
async fn a_deadline_fails_the_task_at_once_even_when_the_agent_ignores_the_cancel() {
    let card = common::agents::card("unresponsive");
    let gateway = baton()
        .agent("unresponsive", common::agents::UnresponsiveAgent(card))
        .start()
        .await;
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(300);
    let mut message = user_message(&message_id("d"), "work");
    message["metadata"] = json!({"urn:baton:handoff:v1": {
        "deadline": baton::protocol::wire::format_timestamp(&deadline)
    }});
    let reply = gateway
        .call_at(
            "/agents/unresponsive/a2a",
            "SendMessage",
            json!({"message": message, "configuration": {"returnImmediately": true}}),
        )
        .await;
    let task_id = reply.result()["task"]["id"].as_str().unwrap().to_string();
    let seconds = chrono::Duration::seconds(1);
    gateway
        .failed_at_deadline("/a2a", &task_id, deadline, seconds)
        .await;
    gateway.stop().await;
}

/// A caller continuing a task may shorten its deadline (DESIGN.md §3.1):
/// the answer's earlier `Baton-Deadline` fails the task then, and the task
/// keeps it.
#[tokio::test]
async fn a_continuation_may_shorten_the_tasks_deadline() {
    let card = common::agents::card("asker");
    let gateway = baton()
        .agent("asker", common::agents::AsksThenWorks(card))
        .start()
        .await;
    let asked = gateway
        .call_at(
            "/agents/asker/a2a",
            "SendMessage",
            json!({"message": user_message(&message_id("q"), "help")}),
        )
        .await;
    let task = &asked.result()["task"];
    assert_eq!(
        task["status"]["state"], "TASK_STATE_INPUT_REQUIRED",
        "{task}"
    );
    let task_id = task["id"].as_str().unwrap().to_string();

    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(500);
    let deadline_text = baton::protocol::wire::format_timestamp(&deadline);
    let answer = json!({"jsonrpc": "2.0", "id": 2, "method": "SendMessage", "params": {
        "message": common::user_message_on(&task_id, &message_id("a"), "here you go"),
        "configuration": {"returnImmediately": true}}});
    let headers = deadline_headers(&deadline_text);
    let reply = gateway
        .post_raw("/agents/asker/a2a", answer.to_string(), &headers)
        .await;
    assert!(reply.code().is_none(), "{}", reply.body);
    let seconds = chrono::Duration::seconds(2);
    let failed = gateway
        .failed_at_deadline("/agents/asker/a2a", &task_id, deadline, seconds)
        .await;
    assert_eq!(
        failed["metadata"]["urn:baton:handoff:v1"]["deadline"], deadline_text,
        "the task keeps the shorter deadline"
    );
    gateway.stop().await;
}

/// A vendor agent that refunds, registered at `gateway` as `billing` with
/// `limits` (`maxHops`, ...).
async fn refunding_billing(gateway: &TestBaton, limits: Value) -> baton::demo::vendor::VendorAgent {
    use baton::demo::vendor::{Reply, VendorAgent};
    let agent = VendorAgent::start("billing", &["refund"], |_| Reply::Complete {
        text: Some("refunded".into()),
        artifacts: vec![],
    })
    .await
    .unwrap();
    let mut params = json!({"id": "billing", "card": agent.card()});
    merge(&mut params, limits);
    let registered = gateway.registry("RegisterAgent", params).await;
    assert!(registered.code().is_none(), "{}", registered.body);
    agent
}

/// What a remote agent gets with a delivery (DESIGN.md §2, §3.1): the call
/// with `returnImmediately`, the control in its metadata and again in
/// headers, the caller's `correlationId` passed on, and the caller's limits
/// taken only where they are shorter than the gateway's.
#[tokio::test]
async fn an_agent_gets_the_control_in_metadata_and_headers_with_limits_never_lengthened() {
    let gateway = baton().start().await;
    let agent = refunding_billing(&gateway, json!({})).await;

    // A day is longer than the gateway's task timeout (300 s), and 50 hops
    // more than its 5: neither is taken.
    let sent_at = chrono::Utc::now();
    let far = sent_at + chrono::Duration::days(1);
    let mut message = user_message(&message_id("ctl"), "refund it");
    message["metadata"] = json!({"urn:baton:handoff:v1": {
        "maxHops": 50,
        "deadline": far.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        "correlationId": "case-7",
    }});
    let reply = gateway
        .call_at(
            "/agents/billing/a2a",
            "SendMessage",
            json!({"message": message}),
        )
        .await;
    assert_eq!(
        reply.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );

    let seen = agent
        .sends()
        .into_iter()
        .next()
        .expect("the agent got the message");
    assert_eq!(seen.params["configuration"]["returnImmediately"], true);
    let control = &seen.params["message"]["metadata"]["urn:baton:handoff:v1"];
    assert_eq!(control["maxHops"], 5, "{control}");
    assert_eq!(control["correlationId"], "case-7");
    assert_eq!(
        (control["hops"].clone(), control["chain"].clone()),
        (json!(1), json!(["billing"]))
    );
    let deadline = control["deadline"].as_str().unwrap();
    let parsed = chrono::DateTime::parse_from_rfc3339(deadline).unwrap();
    assert!(
        parsed <= sent_at + chrono::Duration::seconds(310),
        "{deadline}"
    );
    // The same values in headers, for agents that read headers only.
    assert_eq!(seen.headers["baton-deadline"], deadline);
    assert_eq!(seen.headers["baton-hops"], "1");
    assert_eq!(seen.headers["baton-chain"], "billing");
    agent.stop().await;
    gateway.stop().await;
}

/// An agent learns the gateway task it works on, as its control's
/// `parentTaskId`: a call it makes through the gateway quoting that
/// control (DESIGN.md §3.1) is linked under that task (§3.3), in its trace
/// and its cancel. It was linked under the task's own parent, or nothing.
#[tokio::test]
async fn a_call_an_agent_makes_quoting_its_control_is_linked_under_its_task() {
    use baton::demo::vendor::{Reply, VendorAgent};
    let gateway = baton().start().await;
    let billing = refunding_billing(&gateway, json!({})).await;
    let triage = VendorAgent::start("triage", &["triage"], |_| {
        Reply::AskInput("Which order?".into())
    })
    .await
    .unwrap();
    let registered = gateway
        .registry(
            "RegisterAgent",
            json!({"id": "triage", "card": triage.card()}),
        )
        .await;
    assert!(registered.code().is_none(), "{}", registered.body);

    let message = user_message(&message_id("root"), "refund please");
    let root = gateway
        .call_at(
            "/agents/triage/a2a",
            "SendMessage",
            json!({"message": message}),
        )
        .await;
    let root = root.result()["task"].clone();
    let root_id = root["id"].as_str().unwrap();
    let own = &root["metadata"]["urn:baton:handoff:v1"];
    assert!(own.get("parentTaskId").is_none(), "a root task: {own}");
    let seen = &triage.sends()[0].params["message"]["metadata"]["urn:baton:handoff:v1"];
    assert_eq!(seen["parentTaskId"], root_id, "{seen}");

    // Triage calls billing through the gateway, quoting its control.
    let mut call = user_message(&message_id("child"), "refund order 7");
    call["metadata"] = json!({"urn:baton:handoff:v1": seen});
    let child = gateway
        .call_at(
            "/agents/billing/a2a",
            "SendMessage",
            json!({"message": call}),
        )
        .await;
    let child = child.result()["task"].clone();
    let control = &child["metadata"]["urn:baton:handoff:v1"];
    assert_eq!(control["chain"], json!(["triage", "billing"]), "{control}");
    assert_eq!(control["parentTaskId"], root_id, "{control}");
    let trace = gateway
        .http
        .get(gateway.url(&format!("/tasks/{root_id}/trace")))
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(trace["children"][0]["taskId"], child["id"], "{trace}");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// An agency's own `maxHops` for its agent shortens the gateway's (5).
#[tokio::test]
async fn an_agents_registered_hop_limit_shortens_the_gateways() {
    let gateway = baton().start().await;
    let agent = refunding_billing(&gateway, json!({"maxHops": 2})).await;
    let at_hops = |hops: u32| {
        let mut message = user_message(&message_id("hops"), "refund it");
        message["metadata"] = json!({"urn:baton:handoff:v1": {"hops": hops}});
        json!({"message": message})
    };

    let refused = gateway
        .call_at("/agents/billing/a2a", "SendMessage", at_hops(2))
        .await;
    let task = &refused.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED", "{task}");
    assert_eq!(reason(task), "HOP_LIMIT_EXCEEDED");
    let taken = gateway
        .call_at("/agents/billing/a2a", "SendMessage", at_hops(1))
        .await;
    let task = &taken.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(task["metadata"]["urn:baton:handoff:v1"]["maxHops"], 2);
    let sends = agent.sends().len();
    assert_eq!(sends, 1, "the refused one never reached the agent");
    agent.stop().await;
    gateway.stop().await;
}

/// Routing rules by requested skill (balanced among the agents declaring
/// it), by message metadata, and by a skill's tag (DESIGN.md §5).
#[tokio::test]
async fn routing_rules_match_a_skill_metadata_and_a_tag() {
    use baton::demo::vendor::{Reply, VendorAgent};
    let gateway = baton()
        .routing(
            r#"
            [[route]]
            when = { skill = "refund" }

            [[route]]
            when = { metadata = { "customer.tier" = "gold" } }
            to = { agent = "vip" }

            [[route]]
            when = { tag = "diagnose" }
            "#,
        )
        .start()
        .await;
    let mut agents = Vec::new();
    for (id, skill) in [
        ("billing-a", "refund"),
        ("billing-b", "refund"),
        ("vip", "help"),
        ("tech", "diagnose"),
    ] {
        let agent = VendorAgent::start(id, &[skill], |_| Reply::Complete {
            text: Some("done".into()),
            artifacts: vec![],
        })
        .await
        .unwrap();
        let registered = gateway
            .registry("RegisterAgent", json!({"id": id, "card": agent.card()}))
            .await;
        assert!(registered.code().is_none(), "{}", registered.body);
        agents.push((id, agent));
    }
    let send = |params: Value| {
        let gateway = &gateway;
        async move {
            let reply = gateway.call("SendMessage", params).await;
            let state = &reply.result()["task"]["status"]["state"];
            assert_eq!(state, "TASK_STATE_COMPLETED", "{}", reply.body);
        }
    };
    let message = || user_message(&message_id("r"), "hello");
    for _ in 0..2 {
        send(json!({"message": message(), "metadata": {"skill": "refund"}})).await;
    }
    let mut gold = message();
    gold["metadata"] = json!({"customer": {"tier": "gold"}});
    send(json!({"message": gold})).await;
    send(json!({"message": message(), "metadata": {"skill": "diagnose"}})).await;

    let sends: Vec<(&str, usize)> = agents
        .iter()
        .map(|(id, agent)| {
            let count = agent.sends().len();
            (*id, count)
        })
        .collect();
    assert_eq!(
        sends,
        [("billing-a", 1), ("billing-b", 1), ("vip", 1), ("tech", 1)],
        "the two refunds take turns; gold goes to vip; the diagnose tag to tech"
    );
    for (_, agent) in agents {
        agent.stop().await;
    }
    gateway.stop().await;
}
