//! The `baton` binary's outbound allowances: push webhooks reach the
//! internal networks agents and card fetches may reach, unless
//! `--allow-webhooks` gives them a list of their own.

mod common;
#[path = "common/process.rs"]
mod process;

use common::{message_id, user_message};
use process::BatonProcess;
use serde_json::{Value, json};

/// Creates a push config with a loopback webhook on an INPUT_REQUIRED task
/// of a process started with `args`; the JSON-RPC reply.
async fn loopback_webhook_reply(args: &[&str]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let baton = BatonProcess::builder(dir.path()).args(args).start();
    let message = user_message(&message_id("tck-input-required"), "ask me");
    let task = baton.call("SendMessage", json!({"message": message})).await;
    let task_id = task["task"]["id"].as_str().unwrap();
    let params = json!({"taskId": task_id, "id": "hook", "url": "http://127.0.0.1:9/hook"});
    baton
        .rpc("/a2a", "CreateTaskPushNotificationConfig", params)
        .await
}

#[tokio::test]
async fn webhooks_reach_the_upstream_networks_unless_given_their_own() {
    let upstream = ["--allow-upstream", "127.0.0.0/8"];
    let reply = loopback_webhook_reply(&upstream).await;
    assert_eq!(reply["result"]["url"], "http://127.0.0.1:9/hook", "{reply}");

    let narrowed = [&upstream[..], &["--allow-webhooks", ""]].concat();
    let reply = loopback_webhook_reply(&narrowed).await;
    assert_eq!(reply["error"]["code"], -32602, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.contains("outbound policy"), "{message}");
}
