//! The `baton` binary's bounds on one task: `--max-task-bytes` reaches the
//! gateway (the behaviour itself is tested in `methods.rs` and `upstream.rs`).

mod common;
#[path = "common/process.rs"]
mod process;

use common::{message_id, user_message, user_message_on};
use process::BatonProcess;
use serde_json::json;

#[tokio::test]
async fn max_task_bytes_refuses_a_message_that_would_pass_it() {
    let dir = tempfile::tempdir().unwrap();
    let baton = BatonProcess::builder(dir.path())
        .args(["--max-task-bytes", "1048576", "--max-body-bytes", "1048576"])
        .start();
    let long = "x".repeat(600 * 1024);
    let message = user_message(&message_id("tck-input-required"), &long);
    let task = baton.call("SendMessage", json!({"message": message})).await;
    let task_id = task["task"]["id"].as_str().unwrap();
    let answer = user_message_on(task_id, &message_id("tck-complete-task"), &long);
    let reply = baton
        .rpc("/a2a", "SendMessage", json!({"message": answer}))
        .await;
    assert_eq!(reply["error"]["code"], -32602, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.contains("1048576"), "{message}");
}
