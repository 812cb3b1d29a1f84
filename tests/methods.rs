//! The success path of every A2A method over real HTTP, plus blocking versus
//! returnImmediately, multi-turn, and SSE fan-out to several subscribers.

mod common;

use common::agents::GatedAgent;
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
